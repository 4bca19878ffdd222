"""fp8 products of a few rows (decode at small batches) on fp8 tensor cores, weight rows as the tile's
long side: y[M, N] = (x_q[M, K] sx) (w_q[N, K] sw)^T, M at most 16.

Twin: `fp8_format.dequantized_product` (the sums in float32, then both scales).

cuBLAS's fp8 product tiles the rows of x by 64 or more, so at one row it computes mostly padding
and, on a 4096-wide weight, runs on few blocks; the skinny kernel (kernels/gemv.py) converts every
weight byte to float32 before multiplying, and the conversions, not the loads, set its rate. Here
each program multiplies BLOCK_N whole weight rows by all of x's rows padded to 16, the weight tile
as the MMA's left operand, so the tensor cores take the e4m3 bytes as they are and the loop is
left with its loads, which Triton pipelines. x is quantized per row beforehand
(`fp8_rows.quantize_rows_triton`), as for cuBLAS's product, so a step's numbers do not depend on
which of the two ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.fp8_format import GEMV_MAX_ROWS as MAX_ROWS  # the MMA's short side
from tgserve.kernels.triton_common import pdl, wait_for_inputs


@triton.jit
def _fp8_gemv_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                     stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                     PDL: tl.constexpr = False):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows, the output's columns
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    wait_for_inputs(PDL)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < K) | EVEN_K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # Hopper's fp8 MMA adds into its accumulator with fewer bits than float32 (Triton's default
        # lets it do so over all of K): every IMPRECISE_ACC products the sum is carried into acc in
        # float32, as cuBLAS's product does without its fast-accumulation flag.
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_ACC)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)
    out = acc * x_scale[None, :] * w_scale[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    y_at = y_ptr + rows[None, :] * stride_ym + cols[:, None]
    tl.store(y_at, out.to(y_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


def launch_config(n: int) -> dict:
    """Tile sizes for a weight of n rows, the fastest of bench_gemv.py --fp8's sweep on an H200 for
    Llama-3-8B's projections: enough programs to fill the 132 SMs, and 16-32 KiB of weight a stage."""
    if n >= 128 * 132:  # gate_up
        return {"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3, "IMPRECISE_ACC": 32}
    if n >= 64 * 96:  # qkv
        return {"BLOCK_N": 64, "BLOCK_K": 512, "num_warps": 8, "num_stages": 4, "IMPRECISE_ACC": 32}
    # o_proj and down; at 32 rows a tile Triton takes the MMA of Ampere, as fast here
    return {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 4, "IMPRECISE_ACC": 32}


def fp8_gemv(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """x_q [M, K] fp8 with x_scale float32 [M, 1], times weight [N, K] fp8 with weight_scale float32
    [N, 1], transposed (+ bias): [M, N] in out_dtype, M at most MAX_ROWS."""
    m, k = x_q.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(-1) == 1 and x_q.stride(-1) == 1
    cfg = {**launch_config(n), **(config or {})}
    y = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return y
    _fp8_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x_q, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, y,
        m, n, k, x_q.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        EVEN_K=k % cfg["BLOCK_K"] == 0, IMPRECISE_ACC=cfg["IMPRECISE_ACC"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl(x_q),
    )  # fmt: skip
    return y
