"""What the grouped MoE kernels (`moe.py`) and the one-token GEMVs (`moe_decode.py`) share: the
gating epilogue, computed at the twin's op boundaries, and the operands both take for absent biases
and gating. Its own module so that `moe` can pick `moe_decode`'s path and `moe_decode` can use
these without importing `moe`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.moe_routing import ClampedSwiGLU


@triton.jit
def gated_product(gate, up, alpha, limit, out_ptr, CLAMPED: tl.constexpr):
    """silu(gate) * up, or with CLAMPED `moe_routing.ClampedSwiGLU` (in float32; the twin rounds each
    of its ops in half precision), of the projections' float32 sums: gate and up rounded to the
    output's dtype first, and the gating too, at the twin's op boundaries; in the output's dtype."""
    dtype = out_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        gated = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    else:
        gated = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u
    return gated.to(dtype)


def kernel_operands(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
    gating: ClampedSwiGLU | None,
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The expert kernels' (gate_up biases, down biases, alpha, limit), their unit-stride rows
    checked: x stands in for absent biases (unread without BIAS), (1, 0) for absent gating."""
    assert x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    bias_gate_up, bias_down = biases or (x, x)
    assert biases is None or (bias_gate_up.stride(1) == 1 and bias_down.stride(1) == 1)
    alpha, limit = (gating.alpha, gating.limit) if gating is not None else (1.0, 0.0)
    return bias_gate_up, bias_down, alpha, limit
