"""Triton kernels for Gemma's layer glue: its RMSNorm (scaled by 1 + weight in float32), the norm
after a sublayer added to the residual stream (optionally followed by the next norm), and the
GELU (tanh) gating.

Twins: `reference.gemma_rms_norm`, `gemma_norm_add`, `gelu_tanh_and_mul`. A Gemma 2 / 3 layer has
four norms; in eager torch each is seven small kernels (float copy, square, mean, rsqrt, two
multiplies, cast), the residual adds two more and the gating two: at batch-1 decode on an H200
these took ~0.48 ms of Gemma-2-9B's 2.1 ms a token for 8 layers (families record of
2026-12-05), more than its attention. Here a layer's glue is four launches.

Rounding follows the twins' op boundaries as `fused.py` does: every op in float32, rounded to the
input dtype where torch materialises a tensor in it (the norm's output before the residual add,
the GELU before the multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.fused import _as_rows, _norm_warps, _round_mul
from tgserve.kernels.triton_common import pdl, tanh, wait_for_inputs


@triton.jit
def _gemma_normed(x, weight, n, eps, ty: tl.constexpr):
    """x (float32 row) / rms(x) * (1 + weight), rounded to ty: Gemma's order, scaled in float32."""
    return (x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps) * (1.0 + weight)).to(ty)


@triton.jit
def _gemma_norm_kernel(
    x_ptr, res_ptr, w_ptr, w_next_ptr, out_ptr, next_ptr, rows_inner, stride_x_outer, stride_x_inner, n, eps,
    ADD: tl.constexpr, NEXT: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
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
    y = _gemma_normed(x.to(tl.float32), weight, n, eps, ty)
    if ADD:  # residual + norm(x), the add in float32 rounded once, as torch's
        residual = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0)
        y = (residual.to(tl.float32) + y.to(tl.float32)).to(ty)
    tl.store(out_ptr + row * n + cols, y, mask=mask)
    if NEXT:
        tl.store(
            next_ptr + row * n + cols, _gemma_normed(y.to(tl.float32), weight_next, n, eps, ty), mask=mask
        )


def _launch(x, residual, weight, next_weight, eps, out, next_out) -> None:
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0:
        return
    assert weight.shape == (n,) and weight.is_contiguous()
    xr, inner, sxo, sxi = _as_rows(x)
    block_n = triton.next_power_of_2(n)
    _gemma_norm_kernel[(rows,)](
        xr, residual if residual is not None else out, weight, next_weight if next_weight is not None else weight,
        out, next_out if next_out is not None else out, inner, sxo, sxi, n, eps,
        ADD=residual is not None, NEXT=next_weight is not None, BLOCK_N=block_n, num_warps=_norm_warps(block_n),
        **pdl(x),
    )  # fmt: skip


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of the last dim of x [..., n]: x / rms(x) * (1 + weight) in float32, in x's
    dtype, contiguous."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, None, eps, out, None)
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
    _launch(x, residual.contiguous(), weight, next_weight, eps, hidden, normed)
    return hidden, normed


@triton.jit
def _gelu_tanh_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + inter + cols, mask=mask, other=0.0)
    ty: tl.constexpr = out_ptr.dtype.element_ty
    # torch's tanh GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), rounded before the multiply.
    inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
    act = (0.5 * gate * (1.0 + tanh(inner))).to(ty)
    tl.store(out_ptr + token * inter + cols, _round_mul(act, up, ty), mask=mask)


GELU_BLOCK = 1024


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate_up[..., :I]) * gate_up[..., I:] for gate_up [..., 2I]; a new contiguous [..., I]."""
    width = gate_up.shape[-1]
    assert width % 2 == 0
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // inter if inter else 0
    if rows == 0:
        return out
    x = (gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()).reshape(-1, width)
    block = min(GELU_BLOCK, triton.next_power_of_2(inter))
    _gelu_tanh_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x, out, x.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1, **pdl(x)
    )
    return out
