"""Building a runnable model from a `ModelSource`: native when registered, else the transformers fallback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tgserve.server.distributed.tensor_parallel import tensor_parallel
from tgserve.server.loading.errors import ModelLoadError, refuse_missing_weights
from tgserve.server.loading.hf_compat import dtype_kwargs, renamed_checkpoint_weights
from tgserve.server.loading.language_model import (
    is_language_model_weight,
    language_model_key_mapping,
    language_model_weights,
)
from tgserve.server.loading.quantization import (
    check_checkpoint,
    check_quantize,
    hold_fp8_checkpoint,
    is_fp8_checkpoint,
    quantize_model_fp8,
    without_fp8_extras,
)
from tgserve.server.loading.source import ModelSource, iter_safetensors, safetensors_files, verify_safetensors
from tgserve.server.models.registry import (
    UnsupportedModelError,
    architecture_name,
    check_not_a_draft_model,
    check_required_settings,
    check_supported,
    native_model_class,
)


def load_model(
    source: ModelSource,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    force_fallback: bool = False,
    load_format: str = "auto",
    quantize: str | None = None,
) -> nn.Module:
    """A module with `forward(input_ids [T], positions [T], logits_indices [N]) -> logits [N, vocab]`.

    load_format "dummy" skips the checkpoint and fills the weights with small random values (as
    vLLM's dummy format does): a model of any size benchmarked from its config alone. quantize
    "fp8": the projections' weights are stored and multiplied in fp8 (server/loading/quantization.py).
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    architecture = architecture_name(config)
    check_supported(architecture, trust_remote_code)
    check_not_a_draft_model(config, architecture)
    check_required_settings(config, architecture)
    native = None if force_fallback else native_model_class(architecture, config)
    check_checkpoint(config, source.display_name, native is not None)
    fp8_checkpoint = is_fp8_checkpoint(config)
    check_quantize("fp8" if fp8_checkpoint else quantize, device, native is not None, architecture)
    shards = tensor_parallel().world_size
    if shards > 1 and not getattr(native, "supports_tensor_parallel", False):
        raise ModelLoadError(
            f"{architecture} cannot be split across --num-shard {shards} devices: tensor parallelism "
            "covers the llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) and Gemma 2 / 3; serve it with --num-shard 1"
        )
    if native is None:
        from tgserve.server.models.hf_fallback import load_fallback_model

        dummy = load_format == "dummy"
        if source.gguf_file is None and not dummy:
            # Refuse pickle-only checkpoints and name corrupt files before transformers sees them.
            verify_safetensors(safetensors_files(source, allow_pickle))
        try:
            return load_fallback_model(
                str(source.directory), config, dtype, device, source.gguf_file, trust_remote_code,
                fill_weights=_fill_dummy_weights if dummy else None,
                key_mapping=language_model_key_mapping() if source.language_model_only else None,
            )  # fmt: skip
        except UnsupportedModelError:
            raise  # refused by name: it says why already
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load {source.display_name} through transformers: {exc}") from exc
    model = _construct(native, config, dtype, device)
    if fp8_checkpoint and load_format != "dummy":
        return _load_fp8_checkpoint(model.to(dtype), source, config, device, allow_pickle)
    if load_format == "dummy":
        _fill_dummy_weights(model)
    else:
        model.load_weights(_checkpoint_weights(source, config, device, allow_pickle))
    model = model.to(dtype).eval()
    if quantize == "fp8" or fp8_checkpoint:
        try:
            quantize_model_fp8(model)
        except ValueError as exc:
            raise ModelLoadError(f"cannot quantize {source.display_name} to fp8: {exc}") from exc
    return model


def _load_fp8_checkpoint(
    model: nn.Module, source: ModelSource, config: Any, device: torch.device, allow_pickle: bool
) -> nn.Module:
    """The checkpoint's e4m3 rows and scales copied into fp8 projections as they are."""
    try:
        hold_fp8_checkpoint(model)
        model.load_weights(without_fp8_extras(_checkpoint_weights(source, config, device, allow_pickle)))
    except ValueError as exc:
        raise ModelLoadError(f"cannot load the fp8 checkpoint {source.display_name}: {exc}") from exc
    return model.eval()


@torch.no_grad()
def _fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Uniform in [-1e-3, 1e-3]: small enough that activations stay finite through any depth."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for param in model.parameters():
        param.uniform_(-1e-3, 1e-3, generator=generator)


def _construct(model_class: type, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
        # Buffers some constructors build on the CPU whatever the default device (e.g. RoPE
        # frequencies from transformers' scaled-RoPE helpers) join the parameters.
        return model.to(device)
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_weights(
    source: ModelSource, config: Any, device: torch.device, allow_pickle: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    if source.gguf_file is None:
        keep = is_language_model_weight if source.language_model_only else None
        weights = iter_safetensors(safetensors_files(source, allow_pickle), device, keep=keep)
        if source.language_model_only:
            weights = language_model_weights(weights)
        return renamed_checkpoint_weights(weights, getattr(config, "model_type", ""))
    return _gguf_weights(source, config)


def _gguf_weights(source: ModelSource, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """GGUF tensors renamed and dequantised by transformers' own GGUF loader, in float32."""
    from transformers import AutoModelForCausalLM

    try:
        hf_model, loading = AutoModelForCausalLM.from_pretrained(
            source.directory, gguf_file=source.gguf_file, config=config, output_loading_info=True,
            **dtype_kwargs(torch.float32),
        )  # fmt: skip
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot read GGUF weights {source.display_name}: {exc}") from exc
    refuse_missing_weights(type(hf_model).__name__, source.display_name, loading["missing_keys"])
    yield from hf_model.state_dict().items()
