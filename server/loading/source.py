"""Finding a model (local directory, .gguf file, or Hub id) and reading its config, tokenizer and weights.

Safetensors and GGUF only by default: pickle checkpoints (.bin, .pt) run code when loaded and are
refused unless `allow_pickle` is set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tgserve.server.loading.errors import ModelLoadError, ModelNotFoundError
from tgserve.server.loading.hf_compat import fix_gguf_tokenizer

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class ModelSource:
    """A model on local disk: a directory, and the GGUF file in it when the weights are GGUF;
    `language_model_only`: a multimodal checkpoint of which the language model is served
    (`language_model.py`)."""

    directory: Path
    gguf_file: str | None = None
    language_model_only: bool = False

    @property
    def display_name(self) -> str:
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)


def resolve_model(model: str | None, revision: str | None = None, allow_pickle: bool = False) -> ModelSource:
    """Local .gguf file, local directory, or Hub id (downloaded into HF_HOME); None is the default model."""
    if model is None:
        from tgserve.server.loading.default_model import default_model_gguf

        path = default_model_gguf()
        return ModelSource(path.parent, path.name)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if path.is_dir():
        return _local_directory(path)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelNotFoundError(f"model path {model!r} does not exist")
    return _local_directory(_download(model, revision, allow_pickle))


def _local_directory(path: Path) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource(path)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    raise ModelNotFoundError(f"{path} holds no config.json and not exactly one .gguf file (found {ggufs})")


def _download(repo_id: str, revision: str | None, allow_pickle: bool) -> Path:
    """Fetch a Hub snapshot; huggingface_hub reads HF_TOKEN and HF_HOME itself."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = HUB_PATTERNS + (["*.bin", "*.pt"] if allow_pickle else [])
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path and could not be downloaded from the Hub: {exc}"
        ) from exc


def load_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            source.directory, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the model config in {source.display_name}: {exc}") from exc


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source.directory, gguf_file=source.gguf_file, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {source.display_name}: {exc}") from exc
    if source.gguf_file is not None:
        fix_gguf_tokenizer(tokenizer, source.directory / source.gguf_file)
    processor_template = source.directory / "chat_template.json"
    if not getattr(tokenizer, "chat_template", None) and processor_template.is_file():
        # Multimodal checkpoints may keep the chat template only with their processor, which
        # AutoTokenizer does not read; transformers' AutoProcessor reads it from this file.
        tokenizer.chat_template = json.loads(processor_template.read_text(encoding="utf-8")).get(
            "chat_template"
        )
    return tokenizer


def safetensors_files(source: ModelSource, allow_pickle: bool = False) -> list[Path]:
    files = sorted(source.directory.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(source.directory.glob("*.bin")) + sorted(source.directory.glob("*.pt"))
    if pickles and not allow_pickle:
        raise ModelLoadError(
            f"{source.directory} has only pickle weights ({pickles[0].name}); they can run arbitrary code "
            "when loaded and are refused unless pickle loading is explicitly allowed"
        )
    raise ModelLoadError(f"{source.directory} holds no .safetensors weights")


def verify_safetensors(files: list[Path]) -> None:
    """Open every file's header (cheap) so that a corrupt one is reported by name before loading."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"weights file {file} is corrupt or unreadable: {exc}") from exc


def iter_safetensors(
    files: list[Path], device: torch.device, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file (with `keep`, those whose names it keeps; the
    others are not read); a corrupt file raises naming it."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as handle:
                for name in handle.keys():
                    if keep is None or keep(name):
                        yield name, handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"weights file {file} is corrupt or unreadable: {exc}") from exc
