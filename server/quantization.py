"""Quantized weights: `--quantize fp8`, and checkpoints that come quantized.

`--quantize fp8` stores the native models' linear weights as float8 (e4m3) with one float32 scale
per output row, quantized at load time from the checkpoint's weights, as vLLM's and TGI's `fp8`
do. A step quantizes its activations per row on the fly and multiplies in fp8
(`kernels.dispatch.linear`, `kernels/fp8.py`; a lone decode row keeps its activations as they are). The weights take half the memory of bf16, so a decode step reads half
the bytes and the KV pool gets the rest. The embedding, the LM head and the norms stay in the
serving dtype.

Checkpoints quantized by another tool (AWQ, GPTQ, bitsandbytes, compressed-tensors, fp8 files...)
carry weights this loader would copy as if they were plain ones, so they are refused by name.
GGUF files are dequantized by transformers on load and are served like any other.
"""

from __future__ import annotations

from typing import Any

import torch

from tgserve.server.errors import ModelLoadError

QUANTIZE_METHODS = ("fp8",)


def checkpoint_quantization(config: Any) -> str | None:
    """The `quant_method` a checkpoint's config names, if any (a dict or a transformers config object)."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    if not isinstance(found, dict):
        found = found.to_dict() if hasattr(found, "to_dict") else vars(found)
    return str(found.get("quant_method", "unknown"))


def check_checkpoint(config: Any, display_name: str) -> None:
    """Refuse a checkpoint whose weights were quantized by another tool: the loader would read them as
    plain weights and the model would answer with noise."""
    method = checkpoint_quantization(config)
    if method is None or method == "gguf":
        return
    raise ModelLoadError(
        f"{display_name} is a {method}-quantized checkpoint, which tgserve cannot load: it serves "
        "float32, float16 and bfloat16 checkpoints and GGUF files, and quantizes them to fp8 itself "
        "with --quantize fp8. Serve the model's unquantized checkpoint instead"
    )


def check_quantize(method: str | None, device: torch.device, native: bool, architecture: str) -> None:
    """Refuse `--quantize` where it cannot run, before the weights load."""
    if not method:
        return
    if method not in QUANTIZE_METHODS:
        raise ModelLoadError(f"--quantize must be one of {', '.join(QUANTIZE_METHODS)}; got {method!r}")
    if not native:
        raise ModelLoadError(
            f"--quantize {method} covers the natively served architectures (the llama family); "
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


def quantize_model_fp8(model: torch.nn.Module) -> int:
    """Every layer with a `quantize_fp8_` method (the tensor-parallel linear layers) quantized in
    place; returns how many."""
    layers = [module for module in model.modules() if hasattr(module, "quantize_fp8_")]
    for layer in layers:
        layer.quantize_fp8_()
    return len(layers)
