"""Triton per-row fp8 quantization of a step's activations: one launch instead of torch's six.

Twin: `fp8_format.quantize_rows`, matched bit for bit. The scale is amax * (1 / 448) in float32, or
the one given per row; the division by it is correctly rounded (`div_rn`) as torch's is, and the
conversion to e4m3 rounds to nearest even as torch's does. Whole rows sit in one program's registers
(projection inputs are at most tens of thousands of features), so each row is read once; short rows
(a KV head's keys) go several to a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.fp8_format import FP8, FP8_MAX, INV_FP8_MAX, TINY_SCALE

ROW_ELEMENTS = 4096  # elements a program quantizes: rows of 128 go 32 to a program


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, given_ptr, m, n, stride_x, stride_given, tiny, fp8_max, inv_fp8_max,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GIVEN: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < m
    mask = row_ok[:, None] & (cols[None, :] < n)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GIVEN:
        scale = tl.load(given_ptr + rows * stride_given, mask=row_ok, other=1.0)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), 1), tiny) * inv_fp8_max
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    tl.store(q_ptr + rows[:, None] * n + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=row_ok)


def quantize_rows_triton(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, 1]) of x [M, K] (rows may be strided, columns contiguous);
    `scale` float32 [M, 1] or [1, 1]: divide by it instead of each row's own."""
    rows, n = x.shape
    assert x.stride(1) == 1
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    out_scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    block_m = max(1, ROW_ELEMENTS // block_n)
    given = out_scale if scale is None else scale.float()
    _quantize_rows_kernel[(triton.cdiv(rows, block_m),)](
        x, q, out_scale, given, rows, n, x.stride(0), 0 if given.shape[0] == 1 else given.stride(0),
        TINY_SCALE, FP8_MAX, INV_FP8_MAX,
        BLOCK_M=block_m, BLOCK_N=block_n, GIVEN=scale is not None,
        num_warps=max(1, min(16, block_m * block_n // 512)),
    )  # fmt: skip
    return q, out_scale
