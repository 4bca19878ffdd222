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

from tgserve.kernels.fp8_format import GEMV_MAX_ROWS, dequantized_product, quantize_rows


def quantize_rows_fast(
    rows: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_format.quantize_rows` of rows [M, K] (and a given scale): on CUDA, where the columns
    are contiguous, by the Triton kernel (bit for bit torch's, in one launch and without a float32
    copy of the rows); torch's own elsewhere (the interpreter rounds some values to e4m3 wrongly)."""
    if rows.is_cuda and rows.stride(-1) == 1:
        from tgserve.kernels.fp8_rows import quantize_rows_triton

        return quantize_rows_triton(rows, scale)
    return quantize_rows(rows, scale)


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
        x_q, x_scale = quantize_rows_fast(rows)
        out = torch._scaled_mm(
            x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=torch.bfloat16
        )
    else:
        out = dequantized_product(*quantize_rows(rows), weight, weight_scale)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)
