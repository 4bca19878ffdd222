"""fp8 (e4m3) with one float32 scale per row: the format every fp8 kernel and its twin share, and the
torch twins themselves (`quantize_rows` for kernels/fp8_rows.py, `dequantized_product` for
kernels/fp8_gemv.py and cuBLAS's fp8 product)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
# cuBLASLt's fp8 products take inner and output dimensions in multiples of 16.
FP8_ALIGNMENT = 16
# Up to this many rows, CUDA multiplies in kernels/fp8_gemv.py instead of cuBLAS: on an H200 it took
# Llama-3-8B's four projections in 82 us a layer against cuBLAS's 132, quantization included, from
# 1 to 16 rows (kernels/bench/bench_gemv.py --fp8). 16 is the fp8 MMA's shortest side.
GEMV_MAX_ROWS = 16
TINY_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row gets a scale that divides without nan
# The scale is amax times this constant, not amax / 448: torch divides by a scalar through its
# reciprocal on some devices and not on others, and a multiplication rounds the same everywhere.
INV_FP8_MAX = 1.0 / FP8_MAX


def quantize_rows(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, 1]): each row of x [M, K] scaled so its largest magnitude is
    448, or divided by the given scale (float32 [M, 1], or [1, 1] for every row: `tensor_scale`)."""
    if scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=TINY_SCALE) * INV_FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 [1, 1]: the one scale that brings x's largest magnitude to 448 (two reductions, no
    copy of x: its largest magnitude is the larger of its maximum and minus its minimum)."""
    amax = torch.maximum(x.amax(), -x.amin()).float().clamp(min=TINY_SCALE)
    return (amax * INV_FP8_MAX).reshape(1, 1)


def dequantized_product(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """The CPU's product, bf16 [M, N]: the e4m3 products are exact in float32, summed there, then scaled.
    (torch's CPU `_scaled_mm` took per-tensor scales only in 2.11; row-wise ones from 2.13.)"""
    return ((x_q.float() @ weight.float().t()) * x_scale * weight_scale.t()).to(torch.bfloat16)
