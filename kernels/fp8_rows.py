"""Triton per-row fp8 quantization of a step's activations: one launch instead of torch's six.

Twin: `fp8_format.quantize_rows`, matched bit for bit. The scale is amax * (1 / 448) in float32, the
division by it is correctly rounded (`div_rn`) as torch's is, and the conversion to e4m3 rounds to
nearest even as torch's does. A whole row sits in one program's registers (projection inputs are at most tens of
thousands of features), so the row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.fp8_format import FP8, FP8_MAX, INV_FP8_MAX, TINY_SCALE


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, n, stride_x, tiny, fp8_max, inv_fp8_max, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), tiny) * inv_fp8_max
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, 1]) of x [M, K] (rows may be strided, columns contiguous)."""
    rows, n = x.shape
    assert x.stride(1) == 1
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _quantize_rows_kernel[(rows,)](
        x, q, scale, n, x.stride(0), TINY_SCALE, FP8_MAX, INV_FP8_MAX,
        BLOCK_N=block, num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return q, scale
