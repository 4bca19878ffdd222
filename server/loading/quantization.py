"""Quantized weights: `--quantize fp8`, and checkpoints that come quantized.

`--quantize fp8` stores the native models' linear weights as float8 (e4m3) with one float32 scale
per output row, quantized at load time from the checkpoint's weights, as vLLM's and TGI's `fp8`
do. A step quantizes its activations per row on the fly and multiplies in fp8
(`kernels.dispatch.linear`, `kernels/fp8.py`; a lone decode row keeps its activations as they
are). The weights take half the memory of bf16, so a decode step reads half the bytes and the KV
pool gets the rest. The embedding, the LM head and the norms stay in the serving dtype.

fp8 checkpoints in compressed-tensors' float-quantized format (llm-compressor's FP8 and FP8-dynamic
models) or AutoFP8's load into the same layout as they are: their e4m3 rows and their scales, a
per-tensor scale repeated for each row. Checkpoints quantized otherwise (AWQ, GPTQ, bitsandbytes, block-scaled fp8...)
carry weights this loader would copy as if they were plain ones, so they are refused by name; gpt-oss's
MXFP4 experts are the exception, dequantized by its native loader. GGUF files are dequantized by
transformers on load and are served like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tgserve.server.loading.errors import ModelLoadError

QUANTIZE_METHODS = ("fp8",)


# Tensors of an fp8 checkpoint this server has no use for: static activation scales (activations are
# quantized per token as they come) and per-tensor KV-cache scales (with --kv-cache-dtype fp8 the
# cache scales each token's row per KV head as it writes it, which no per-tensor scale outdoes).
FP8_CHECKPOINT_EXTRAS = (".input_scale", ".output_scale", ".k_scale", ".v_scale")


def quantization_config(config: Any) -> dict[str, Any] | None:
    """A checkpoint config's `quantization_config` as a dict (it may be a transformers config object)."""
    found = getattr(config, "quantization_config", None)
    if found is None or isinstance(found, dict):
        return found
    return found.to_dict() if hasattr(found, "to_dict") else vars(found)


def checkpoint_quantization(config: Any) -> str | None:
    """The `quant_method` a checkpoint's config names, if any."""
    found = quantization_config(config)
    return None if found is None else str(found.get("quant_method", "unknown"))


def is_fp8_checkpoint(config: Any) -> bool:
    """An fp8 checkpoint this server loads as it is: weights in e4m3 with a `weight_scale` per output
    row or per tensor. compressed-tensors' float-quantized format (as llm-compressor writes the FP8
    and FP8-dynamic models), or AutoFP8's `fp8` (the older FP8 models; transformers' block-scaled
    `fp8`, with `weight_block_size`, is another layout). Activations are quantized per token here,
    whatever the checkpoint's scheme."""
    found = quantization_config(config)
    if not found:
        return False
    if found.get("quant_method") == "fp8":
        return found.get("weight_block_size") is None and found.get("activation_scheme") in (
            "static",
            "dynamic",
        )
    if found.get("quant_method") != "compressed-tensors" or found.get("format") != "float-quantized":
        return False
    groups = list((found.get("config_groups") or {}).values())

    def fp8(spec: Any) -> bool:
        return isinstance(spec, dict) and spec.get("type") == "float" and spec.get("num_bits") == 8

    return bool(groups) and all(
        fp8(group.get("weights"))
        and group["weights"].get("strategy") in ("channel", "tensor")
        and group["weights"].get("symmetric", True)
        and (group.get("input_activations") is None or fp8(group["input_activations"]))
        for group in groups
    )


def check_checkpoint(config: Any, display_name: str, native: bool) -> None:
    """Refuse a checkpoint quantized in a way this loader does not read: it would copy the weights as
    plain ones and the model would answer with noise."""
    method = checkpoint_quantization(config)
    if method is None or method == "gguf":
        return
    if method == "mxfp4" and native and getattr(config, "model_type", None) == "gpt_oss":
        return  # OpenAI's gpt-oss checkpoints: the experts dequantized as they load (models/gpt_oss.py)
    if is_fp8_checkpoint(config):
        if not native:
            raise ModelLoadError(
                f"{display_name} is an fp8 checkpoint; fp8 checkpoints load natively, for the llama family "
                "(Llama, Mistral, Qwen2, Qwen3, Phi-3), Gemma 2 / 3 and the mixtures of experts (Mixtral, Qwen2-MoE, "
                "Qwen3-MoE): serve this model's unquantized checkpoint instead"
            )
        return
    raise ModelLoadError(
        f"{display_name} is a {method}-quantized checkpoint in a form tgserve cannot load. It serves "
        "float32, float16 and bfloat16 checkpoints, GGUF files, and fp8 checkpoints with a scale per output "
        "row or per tensor (compressed-tensors' float-quantized format, AutoFP8's), and quantizes to fp8 "
        "itself with --quantize fp8. Serve the model's unquantized checkpoint instead"
    )


def check_quantize(method: str | None, device: torch.device, native: bool, architecture: str) -> None:
    """Refuse `--quantize` where it cannot run, before the weights load."""
    if not method:
        return
    if method not in QUANTIZE_METHODS:
        raise ModelLoadError(f"--quantize must be one of {', '.join(QUANTIZE_METHODS)}; got {method!r}")
    if not native:
        raise ModelLoadError(
            f"--quantize {method} covers the natively served architectures (the llama family, Gemma 2 / 3, "
            "the mixtures of experts); "
            f"{architecture} runs through transformers: serve it without --quantize"
        )
    if device.type == "hpu":
        raise ModelLoadError(f"--quantize {method} runs on CUDA GPUs and the CPU, not on Gaudi")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ModelLoadError(
            f"--quantize {method} needs fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
            f"Blackwell); {name} has {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
        )


def hold_fp8_checkpoint(model: torch.nn.Module) -> None:
    """Every quantizable projection made ready to take an fp8 checkpoint's rows and scales as they are."""
    for module in model.modules():
        if hasattr(module, "hold_fp8_checkpoint_"):
            module.hold_fp8_checkpoint_()


def without_fp8_extras(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, tensor) for name, tensor in weights if not name.endswith(FP8_CHECKPOINT_EXTRAS))


def quantize_model_fp8(model: torch.nn.Module) -> None:
    """Every quantizable projection (the tensor-parallel linear layers) quantized to fp8 in place."""
    for module in model.modules():
        if hasattr(module, "quantize_fp8_"):
            module.quantize_fp8_()
