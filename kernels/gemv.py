"""Triton skinny linear layer for batch-1 decode: y[M, N] = x[M, K] @ W[N, K]^T (+ b), M tiny.

Twin: `F.linear`.

At batch 1, cuBLAS splits the K of a small projection (Llama-3-8B's o_proj, 4096 x 4096) over
extra programs and then launches a separate reduction: on an H200 the pair takes 13.4 us for 33.5
MB, 2.5 TB/s, in a CUDA graph. Here each program streams BLOCK_N whole weight rows (no split, no
reduction kernel), keeping the next tile's load in flight while it multiplies the current one, and
partial sums per lane until the end (one cross-thread reduction per program): 11.4 us.
`dispatch.linear` sends only the shapes where that was measured faster, with the setting measured
fastest on the device (kernels/gemv_settings.py, kernels/bench/bench_gemv.py --tune); two rows or
more stay cuBLAS's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import pdl, wait_for_inputs


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    w_next = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    # The first weight tile is in flight while the kernel before finishes (under PDL).
    wait_for_inputs(PDL)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = w_next
        ahead = ks + BLOCK_K
        w_next = tl.load(w_rows + ahead[None, :], mask=col_ok[:, None] & (ahead < K)[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :],
                    other=0.0)  # fmt: skip
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, 2)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_at = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_at, out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


CONFIG = {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 4}  # the fastest of the sweep on an H200: the default


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias), any M, meant for M of one or two."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(-1) == 1 and x.stride(-1) == 1
    cfg = {**CONFIG, **(config or {})}
    block_m = triton.next_power_of_2(m)
    # The accumulator holds M x N x K floats: at most 64 registers a thread.
    block_k = min(cfg["BLOCK_K"], max(16, 64 * 32 * cfg["num_warps"] // (block_m * cfg["BLOCK_N"])))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _skinny_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=1, **pdl(x),
    )  # fmt: skip
    return y
