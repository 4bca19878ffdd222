"""The transformers fallback's RMSNorms on tgserve's kernels, where one of them matches exactly.

transformers writes an RMSNorm class per architecture, in one of a few orders: Llama's casts the
normed row before scaling it, OLMo's scales in float32 and then casts, Gemma's scales by 1 + weight
in float32. In eager torch each is six or seven small kernels; at batch-1 decode of OLMo-2-7B's
shape on an H200 (four norms a layer, its query and key norms included) elementwise and reduce
kernels took ~30% of the fallback's step, these among them. A norm module is replaced only when
one of the kernels' twins gives its output bit for bit on a probe (rows of very different
scales, in the model's dtype, on its device); on the CPU the replacement then computes exactly
what the module did, on CUDA the Triton kernel (within the kernels' usual rounding of the mean).
Anything else stays as transformers wrote it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

from tgserve.kernels import dispatch, reference

logger = logging.getLogger(__name__)

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

# (twin that decides, entry point that runs): the twin is the entry point's CPU path.
CANDIDATES: tuple[tuple[Norm, Norm], ...] = (
    (reference.rms_norm, dispatch.rms_norm),  # weight * normed.to(dtype): Llama's
    (reference.float_scaled_rms_norm, dispatch.float_scaled_rms_norm),  # (weight * normed).to(dtype): OLMo's
    (reference.gemma_rms_norm, dispatch.gemma_rms_norm),  # (normed * (1 + weight)).to(dtype): Gemma's
)
PROBE_SCALES = (1e-2, 1.0, 30.0, 1e3)


class KernelRMSNorm(nn.Module):
    """An RMSNorm module's weight (the same parameter) and epsilon, normed by a tgserve kernel."""

    def __init__(self, weight: nn.Parameter, eps: float, norm: Norm) -> None:
        super().__init__()
        self.weight, self.eps, self.norm = weight, eps, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _is_plain_norm(module: nn.Module) -> bool:
    """An RMSNorm-named module with one 1-D weight, no buffers, children or hooks, and a forward of
    one argument: a candidate for the probe."""
    weight = getattr(module, "weight", None)
    return (
        "rmsnorm" in type(module).__name__.lower()
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and len(list(module.parameters())) == 1
        and not list(module.buffers())
        and not list(module.children())
        and not hasattr(module, "_hf_hook")  # accelerate's offloading wraps forward
        and len(inspect.signature(module.forward).parameters) == 1
    )


def matching_norm(module: nn.Module, dtype: torch.dtype) -> Norm | None:
    """The kernel entry point whose twin gives this module's output exactly, if any."""
    eps = _epsilon(module)
    if eps is None or not _is_plain_norm(module):
        return None
    width = module.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor(PROBE_SCALES)[:, None]
    probe = (torch.randn(len(PROBE_SCALES), width, generator=gen) * scales).to(dtype).to(module.weight.device)
    with torch.no_grad():
        want = module(probe)
        for twin, entry in CANDIDATES:
            got = twin(probe, module.weight, eps)
            if got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want):
                return entry
    return None


def swap_in_kernel_norms(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace each RMSNorm module that a kernel matches exactly; how many were replaced."""
    swapped = 0
    for name, module in list(model.named_modules()):
        norm = matching_norm(module, dtype) if name else None
        if norm is None:
            continue
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, KernelRMSNorm(module.weight, _epsilon(module), norm))
        swapped += 1
    if swapped:
        logger.info("transformers fallback: %d RMSNorm modules run on tgserve's kernels", swapped)
    return swapped
