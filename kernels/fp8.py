"""fp8 (e4m3) projections with one scale per row: weights quantized once, activations per step.

y = (x_q * sx) (w_q * sw)^T, with x_q, w_q in float8_e4m3fn, sx [M, 1] and sw [N, 1] in float32, each
row scaled so that its largest magnitude maps to 448. On CUDA the product runs on fp8 tensor
cores through `torch._scaled_mm` (cuBLASLt), accumulating in float32 and writing bfloat16 (row-wise
scales produce bfloat16 only); the CPU computes the same sums in float32 and rounds to bfloat16 too.
The result is converted to the caller's dtype.

Up to 16 rows (decode at small batches) CUDA takes kernels/fp8_gemv.py instead of cuBLAS: the same
quantized rows and sums, on tensor cores with the weight rows as the tile's long side.
"""

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


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, 1]): each row of x [M, K] scaled so its largest magnitude is 448."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=TINY_SCALE) * INV_FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ dequantized weight [N, K]^T + bias, in x's dtype; weight fp8, weight_scale float32 [N, 1]."""
    rows = x.reshape(-1, x.shape[-1])
    out_features = weight.shape[0]
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    if rows.is_cuda and rows.shape[0] <= GEMV_MAX_ROWS and rows.stride(-1) == 1:
        from tgserve.kernels.fp8_gemv import fp8_gemv
        from tgserve.kernels.fp8_rows import quantize_rows_triton

        out = fp8_gemv(*quantize_rows_triton(rows), weight, weight_scale, bias, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], out_features)
    if rows.is_cuda:
        from tgserve.kernels.fp8_rows import quantize_rows_triton

        x_q, x_scale = quantize_rows_triton(rows) if rows.stride(-1) == 1 else quantize_rows(rows)
        out = torch._scaled_mm(
            x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=torch.bfloat16
        )
    else:
        out = _dequantized_product(*quantize_rows(rows), weight, weight_scale)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


def _dequantized_product(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """The CPU's product, bf16 [M, N]: the e4m3 products are exact in float32, summed there, then scaled.
    (torch's CPU `_scaled_mm` took per-tensor scales only in 2.11; row-wise ones from 2.13.)"""
    return ((x_q.float() @ weight.float().t()) * x_scale * weight_scale.t()).to(torch.bfloat16)
