"""Triton RMSNorms that scale in float32 before the cast: Gemma's (by 1 + weight) and OLMo's kind
(by weight, `(weight * normed).to(dtype)`), where Llama's casts first (`fused.rms_norm`); and the
norm after a sublayer added to the residual stream, optionally followed by the next norm (Gemma's
sandwich).

Twins: `reference.gemma_rms_norm`, `gemma_norm_add`, `float_scaled_rms_norm`. A Gemma 2 / 3 layer
has four norms; in eager torch each is seven small kernels (float copy, square, mean, rsqrt, two
multiplies, cast) and the residual adds two more: at batch-1 decode on an H200 these and the
gating took ~0.48 ms of Gemma-2-9B's 2.1 ms a token for 8 layers (families record of
2026-12-05), more than its attention. Here a norm, or a norm, the add and the next norm, is one
launch. The transformers fallback takes the same kernels for modules whose output they match
exactly (`server/models/fallback_norms.py`).

Rounding follows the twins' op boundaries as `fused.py` does: every op in float32, rounded to the
input dtype where torch materialises a tensor in it (the norm's output before the residual add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.fused import _as_rows, _norm_warps
from tgserve.kernels.triton_common import pdl, wait_for_inputs


@triton.jit
def _scaled_normed(x, weight, n, eps, ty: tl.constexpr, OFFSET: tl.constexpr):
    """x (float32 row) / rms(x) * (OFFSET + weight), scaled in float32, then rounded to ty."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    if OFFSET != 0:
        return (normed * (OFFSET + weight)).to(ty)
    return (normed * weight).to(ty)


@triton.jit
def _scaled_norm_kernel(
    x_ptr, res_ptr, w_ptr, w_next_ptr, out_ptr, next_ptr, rows_inner, stride_x_outer, stride_x_inner, n, eps,
    OFFSET: tl.constexpr, ADD: tl.constexpr, NEXT: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # Rows are (outer, inner) pairs: per-head views of a fused QKV output (Gemma 3's query and key
    # norms) need no copy. The residual and every output are contiguous rows.
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // rows_inner, row % rows_inner
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # weights: before the wait
    if NEXT:
        weight_next = tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    ty: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    y = _scaled_normed(x.to(tl.float32), weight, n, eps, ty, OFFSET)
    if ADD:  # residual + norm(x), the add in float32 rounded once, as torch's
        residual = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0)
        y = (residual.to(tl.float32) + y.to(tl.float32)).to(ty)
    tl.store(out_ptr + row * n + cols, y, mask=mask)
    if NEXT:
        z = _scaled_normed(y.to(tl.float32), weight_next, n, eps, ty, OFFSET)
        tl.store(next_ptr + row * n + cols, z, mask=mask)


def _launch(x, residual, weight, next_weight, eps, out, next_out, offset: float) -> None:
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0:
        return
    assert weight.shape == (n,) and weight.is_contiguous()
    xr, inner, sxo, sxi = _as_rows(x)
    block_n = triton.next_power_of_2(n)
    _scaled_norm_kernel[(rows,)](
        xr, residual if residual is not None else out, weight, next_weight if next_weight is not None else weight,
        out, next_out if next_out is not None else out, inner, sxo, sxi, n, eps,
        OFFSET=offset, ADD=residual is not None, NEXT=next_weight is not None, BLOCK_N=block_n,
        num_warps=_norm_warps(block_n), **pdl(x),
    )  # fmt: skip


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of the last dim of x [..., n]: x / rms(x) * (1 + weight) in float32, in x's
    dtype, contiguous."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, None, eps, out, None, offset=1.0)
    return out


def float_scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`(weight * (x / rms(x))).to(x.dtype)`, the product in float32 (OLMo's RMSNorm, among others
    in transformers), contiguous."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, None, eps, out, None, offset=0.0)
    return out


def gemma_norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual + gemma_rms_norm(x, weight), and with next_weight that sum's own norm by it): a
    sublayer's output normed into the residual stream, and the next sublayer's input, in one pass."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    hidden = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(hidden) if next_weight is not None else None
    _launch(x, residual.contiguous(), weight, next_weight, eps, hidden, normed, offset=1.0)
    return hidden, normed
