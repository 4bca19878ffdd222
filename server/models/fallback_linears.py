"""The transformers fallback's one-row projections on tgserve's skinny GEMV kernel.

At batch-1 decode every projection is one row through its weight. For weights of up to 4096 rows
cuBLAS splits the reduction and launches a second kernel to sum it; on OLMo-2-7B's fallback (H100,
8 layers) those split GEMVs and their reductions were over a third of the step. The native models
send such rows through `dispatch.linear`, whose skinny kernel measured faster there (see
`kernels/gemv_settings.py`). Each plain `nn.Linear` of a fallback model becomes a `KernelLinear`
in place (its class changed, so parameters, attributes, hooks and tied weights stay as they
were): one row on CUDA goes to `dispatch.linear`, everything else to `F.linear` as before, so CPU
results are unchanged bit for bit.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tgserve.kernels import dispatch

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KernelLinear(nn.Linear):
    """nn.Linear whose one-row CUDA products take `dispatch.linear` (the skinny kernel where it
    is faster, cuBLAS otherwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.numel() == x.shape[-1] and x.dtype == self.weight.dtype:
            row = dispatch.linear(x.reshape(1, -1), self.weight, self.bias)
            return row.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def _is_plain_linear(module: nn.Module) -> bool:
    """Exactly nn.Linear (no quantized or adapter subclass), unwrapped, in a dtype the kernel reads."""
    return (
        type(module) is nn.Linear
        and module.weight.dtype in KERNEL_DTYPES
        and not hasattr(module, "_hf_hook")  # accelerate's offloading wraps forward
    )


def swap_in_kernel_linears(model: nn.Module) -> int:
    """Turn each plain nn.Linear of the model into a KernelLinear; how many were turned."""
    swapped = 0
    for module in model.modules():
        if _is_plain_linear(module):
            module.__class__ = KernelLinear
            swapped += 1
    if swapped:
        logger.info("transformers fallback: %d linear modules take tgserve's one-row kernel", swapped)
    return swapped
