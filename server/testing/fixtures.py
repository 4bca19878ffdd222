"""Tiny random-weight models of many architectures, built fully offline and cached on disk.

Every fixture directory holds what a Hub checkpoint holds: config.json, generation_config.json,
model.safetensors (float32) and the shared tokenizer files, so it loads with
`AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)`.

    path = fixture_path("mistral")            # built once, then reused from the cache
    path = build_fixture("gemma2", tmp_path)  # always builds (into tmp_path/gemma2-<version>)

Weights: INIT_STD = 0.15 for every matrix (see tiny_configs), biases and norm weights randomised too,
and a seed search: seeds are tried in order until greedy decoding of every CHECK_PROMPTS prompt gives
CHECK_NEW_TOKENS tokens, none of them EOS, with at least MIN_DISTINCT distinct ones. A random tiny
model otherwise often falls into repeating one token, which makes greedy-parity tests vacuous. The
search is deterministic, so a build gives the same weights every time on one software stack.

Cache: directories are named `<arch>-<version>`, the version hashing this package's source and the
torch/transformers/tokenizers versions, so any change to the factory builds fresh fixtures. Builds
go to a temporary directory renamed into place, so concurrent pytest workers never see half a model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from . import tiny_configs, tiny_tokenizer
from .tiny_configs import CONFIG_BUILDERS, TokenIds, build_config

FACTORY_VERSION = "1"
FIXTURE_ARCHITECTURES: tuple[str, ...] = tuple(CONFIG_BUILDERS)

CHECK_PROMPTS: tuple[str, ...] = (
    "Hello! How are you today?",
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time there was a small village at the edge of a great forest.",
    "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n",
    "The the the the",
)
CHECK_NEW_TOKENS = 32
MIN_DISTINCT = 8
FIRST_SEED = 0
MAX_SEED_ATTEMPTS = 32
MARKER_FILE = "tgserve-fixture.json"
_SOURCE_MODULES = (tiny_configs, tiny_tokenizer)


@functools.lru_cache(maxsize=1)
def fixture_version() -> str:
    """`v<FACTORY_VERSION>-<hash>` of this package's source and the library versions that shape weights."""
    import tokenizers
    import torch
    import transformers

    digest = hashlib.sha256()
    for path in [Path(__file__), *(Path(m.__file__) for m in _SOURCE_MODULES)]:
        digest.update(path.read_bytes())
    for version in (torch.__version__, transformers.__version__, tokenizers.__version__):
        digest.update(version.encode())
    return f"v{FACTORY_VERSION}-{digest.hexdigest()[:10]}"


def default_cache_dir() -> Path:
    """`<repo root>/.cache/tgserve-fixtures` inside a checkout, else `~/.cache/tgserve/fixtures`."""
    repo_root = Path(__file__).resolve().parents[2]
    if (repo_root / "pyproject.toml").is_file() and (repo_root / "server" / "testing").is_dir():
        return repo_root / ".cache" / "tgserve-fixtures"
    return Path.home() / ".cache" / "tgserve" / "fixtures"


def fixture_path(arch: str, cache_dir: Path | None = None) -> Path:
    """The cached fixture directory of `arch`, building it only if it is missing."""
    _check_arch(arch)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{arch}-{fixture_version()}"
    if target.is_dir():
        return target
    return build_fixture(arch, root)


def build_fixture(arch: str, root: Path) -> Path:
    """Build the fixture of `arch` into `root/<arch>-<version>` and return that directory.

    Always builds; if another process publishes the same directory first, its copy is kept (builds
    are deterministic, so the two are the same model).
    """
    _check_arch(arch)
    root = Path(root)
    tokenizer_dir = _tokenizer_dir(root)
    return _publish_atomically(
        root / f"{arch}-{fixture_version()}", lambda out: _write_model(arch, tokenizer_dir, out)
    )


def write_corrupt_copy(src: Path, dst: Path, mode: Literal["truncate", "header"] = "truncate") -> Path:
    """Copy the fixture `src` to `dst` and damage its model.safetensors, for error-handling tests.

    mode "truncate" keeps the header but cuts the file in half (tensor data missing); "header"
    overwrites the 8-byte header length and the start of the JSON header with garbage.
    """
    if mode not in ("truncate", "header"):
        raise ValueError(f"mode must be 'truncate' or 'header', not {mode!r}")
    dst = Path(dst)
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if mode == "truncate":
        with weights.open("r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    else:
        with weights.open("r+b") as f:
            f.write(b"\xff" * 8 + b"not json" * 4)
    return dst


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    strategy: Literal["channel", "tensor"],
    layout: Literal["compressed-tensors", "autofp8"] = "compressed-tensors",
) -> Path:
    """Copy the fixture `src` to `dst` as llm-compressor writes an FP8 model (compressed-tensors,
    float-quantized), or as AutoFP8 does (`fp8`, scalar scales): e4m3 projection weights, each with
    its `weight_scale` (a scale per row, or one for the tensor), and the static `input_scale`s and
    KV-cache scales such files also carry."""
    import torch
    from safetensors.torch import load_file, save_file

    from tgserve.kernels.fp8_format import quantize_rows

    dst = Path(dst)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if layout == "autofp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
        group = {"weights": weights, "input_activations": activations, "targets": ["Linear"]}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, tensor in load_file(dst / "model.safetensors").items():
        tensors[name] = tensor
        if name.endswith("proj.weight") and ".layers." in name:
            rows = tensor if strategy == "channel" else tensor.reshape(1, -1)
            q, scale = quantize_rows(rows)
            tensors[name] = q.reshape(tensor.shape)
            per_tensor = () if layout == "autofp8" else (1,)
            tensors[name.replace(".weight", ".weight_scale")] = (
                scale if strategy == "channel" else scale.reshape(per_tensor)
            )
            tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
        if name.endswith("self_attn.k_proj.weight"):
            tensors[name.replace("k_proj.weight", "k_scale")] = torch.ones(())
    save_file(tensors, dst / "model.safetensors")
    return dst


def _check_arch(arch: str) -> None:
    """Raise KeyError naming the known architectures when `arch` is not one of them."""
    if arch not in CONFIG_BUILDERS:
        raise KeyError(f"unknown fixture architecture {arch!r}; known: {', '.join(FIXTURE_ARCHITECTURES)}")


def _tokenizer_dir(root: Path) -> Path:
    """The shared tokenizer, trained once per cache root and version."""
    target = root / f"tokenizer-{fixture_version()}"
    if target.is_dir():
        return target
    return _publish_atomically(target, tiny_tokenizer.save_fast_tokenizer)


def _publish_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Run `write` into a fresh temporary directory next to `target`, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the published fixture should be readable by all
        write(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # a concurrent builder winning the rename is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _token_ids(tokenizer_dir: Path) -> TokenIds:
    """Vocabulary size and special ids of the shared tokenizer, read without loading transformers."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def token_id(token: str) -> int:
        found = tokenizer.token_to_id(token)
        assert found is not None, token
        return found

    return TokenIds(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=token_id(tiny_tokenizer.BOS_TOKEN),
        eos_token_id=token_id(tiny_tokenizer.EOS_TOKEN),
        pad_token_id=token_id(tiny_tokenizer.PAD_TOKEN),
    )


def _write_model(arch: str, tokenizer_dir: Path, out: Path) -> None:
    """Build, check and save the model of `arch` plus the tokenizer files into `out`."""
    from transformers import GenerationConfig

    ids = _token_ids(tokenizer_dir)
    config = build_config(arch, ids)
    with single_threaded_torch():
        model, seed = _lively_model(arch, config, _encode_prompts(tokenizer_dir))
    model.generation_config = GenerationConfig(
        bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id
    )
    model.save_pretrained(out, save_original_format=True)
    for item in tokenizer_dir.iterdir():
        shutil.copy2(item, out / item.name)
    marker = {"arch": arch, "version": fixture_version(), "seed": seed, "init_std": tiny_configs.INIT_STD}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch on one CPU thread inside the block, restoring the previous count after.

    Tiny models gain nothing from intra-op threads, and on a busy machine (parallel pytest workers)
    thread contention makes a 64x64 matmul hundreds of times slower than on one thread.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _encode_prompts(tokenizer_dir: Path) -> list[list[int]]:
    """CHECK_PROMPTS as token ids, exactly as the fast tokenizer encodes them (no BOS is added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [tokenizer.encode(prompt).ids for prompt in CHECK_PROMPTS]


def _lively_model(arch: str, config: Any, prompts: list[list[int]]) -> tuple[Any, int]:
    """The first seeded model whose greedy outputs pass `greedy_is_lively`, and its seed."""
    for seed in range(FIRST_SEED, FIRST_SEED + MAX_SEED_ATTEMPTS):
        model = random_model(arch, config, seed)
        if all(greedy_is_lively(model, prompt, config.eos_token_id) for prompt in prompts):
            return model, seed
    raise RuntimeError(f"no seed in {MAX_SEED_ATTEMPTS} attempts gave {arch} non-degenerate greedy outputs")


def random_model(arch: str, config: Any, seed: int) -> Any:
    """A float32 model of `config` with the fixture initialisation, reproducible from `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    from tgserve.server.loading.hf_compat import dtype_kwargs

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32))
    tiny_configs.finish_init(arch, model)
    return model.eval()


def greedy_is_lively(model: Any, prompt_ids: list[int], eos_token_id: int) -> bool:
    """Whether greedy decoding runs CHECK_NEW_TOKENS tokens without EOS, with MIN_DISTINCT distinct ones."""
    import torch

    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=CHECK_NEW_TOKENS,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    new_tokens = output[0, len(prompt_ids) :].tolist()
    return (
        len(new_tokens) == CHECK_NEW_TOKENS
        and eos_token_id not in new_tokens
        and len(set(new_tokens)) >= MIN_DISTINCT
    )
