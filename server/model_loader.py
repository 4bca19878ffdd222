"""Building a runnable model from a `ModelSource`: native when registered, else the transformers fallback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tgserve.server.errors import ModelLoadError
from tgserve.server.loader import ModelSource, iter_safetensors, safetensors_files, verify_safetensors
from tgserve.server.models.registry import architecture_name, check_supported, native_model_class


def load_model(
    source: ModelSource,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    force_fallback: bool = False,
) -> nn.Module:
    """A module with `forward(input_ids [T], positions [T], logits_indices [N]) -> logits [N, vocab]`."""
    architecture = architecture_name(config)
    check_supported(architecture, trust_remote_code)
    native = None if force_fallback else native_model_class(architecture)
    if native is None:
        from tgserve.server.models.hf_fallback import load_fallback_model

        if source.gguf_file is None:
            # Refuse pickle-only checkpoints and name corrupt files before transformers sees them.
            verify_safetensors(safetensors_files(source, allow_pickle))
        try:
            return load_fallback_model(
                str(source.directory), config, dtype, device, source.gguf_file, trust_remote_code
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load {source.display_name} through transformers: {exc}") from exc
    model = _construct(native, config, dtype, device)
    model.load_weights(_checkpoint_weights(source, config, device, allow_pickle))
    return model.to(dtype).eval()


def _construct(model_class: type, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config)
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_weights(
    source: ModelSource, config: Any, device: torch.device, allow_pickle: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    if source.gguf_file is None:
        return iter_safetensors(safetensors_files(source, allow_pickle), device)
    return _gguf_weights(source, config)


def _gguf_weights(source: ModelSource, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """GGUF tensors renamed and dequantised by transformers' own GGUF loader, in float32."""
    from transformers import AutoModelForCausalLM

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            source.directory, gguf_file=source.gguf_file, config=config, dtype=torch.float32
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot read GGUF weights {source.display_name}: {exc}") from exc
    yield from hf_model.state_dict().items()
