"""Triton mixture-of-experts for one token (batch-1 decode): its k experts as GEMVs.

Twin: `reference.fused_moe` with one row. `moe.fused_moe_triton` runs a decode row through the grouped
GEMMs of prompt steps: each chosen expert a block of 16 rows for `tl.dot`, one of them real, then
the k rows summed by torch (a sum and a cast, two launches). At batch 1 the layer is bound by
reading the chosen experts' weights; here they stream as `gemv.py`'s skinny kernel streams a
projection: each program takes whole weight rows, the next tile's load in flight while it
multiplies the current one, partial sums per lane until one reduction at the end.

Two launches: gate and up for every (slot, tile of intermediate rows), storing the gated row of
each slot; then the down projection for a tile of hidden rows, over the k slots in order, each
slot's output rounded and weighted as the grouped kernels round it, summed in float32 and stored
once in the token's dtype. `moe.ONE_TOKEN_GEMV` switches a one-token step to this path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.moe_common import gated_product, kernel_operands
from tgserve.kernels.moe_routing import ClampedSwiGLU
from tgserve.kernels.triton_common import interpreting, pdl, wait_for_inputs

# Rows a program streams, the reduction's tile, warps; the interpreter takes small tiles to stay fast.
# H100 sweeps (kernels/bench/bench_moe.py --one-token): 4 / 512 / 4 fastest for both kernels jointly
# on all three MoE families; each kernel's own best is within 1-2% of it.
GATE_UP_LAUNCH = {"block_n": 4, "block_k": 512, "num_warps": 4}
DOWN_LAUNCH = {"block_n": 4, "block_k": 512, "num_warps": 4}
INTERPRETER_LAUNCH = {"block_n": 4, "block_k": 16, "num_warps": 1}


@triton.jit
def _row_products(x_ptr, w_rows, n_ok, width, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k of x[k] * w_rows[:, k] for the [BLOCK_N] rows at w_rows (row-0 pointers), in
    float32: the next tile loaded while this one is multiplied, partial sums per lane."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_next = tl.load(w_rows[:, None] + ks[None, :], mask=n_ok[:, None] & (ks < width)[None, :], other=0.0)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = w_next
        ahead = ks + BLOCK_K
        w_next = tl.load(w_rows[:, None] + ahead[None, :], mask=n_ok[:, None] & (ahead < width)[None, :],
                         other=0.0)  # fmt: skip
        x = tl.load(x_ptr + ks, mask=ks < width, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, out_ptr, bias_ptr, hidden, inter, stride_we, stride_wn, stride_be, alpha, limit,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    # Gate and up rows interleaved (gate n, up n, ...): one streamed loop, each x tile loaded once.
    pair = tl.arange(0, 2 * BLOCK_N)
    pair_n = tl.program_id(1) * BLOCK_N + pair // 2
    pair_rows = w_ptr + expert * stride_we + (pair_n + (pair % 2) * inter).to(tl.int64) * stride_wn
    both = _row_products(x_ptr, pair_rows, pair_n < inter, hidden, 2 * BLOCK_N, BLOCK_K)
    gate, up = tl.split(tl.reshape(both, (BLOCK_N, 2)))
    if BIAS:  # gpt-oss: each projection's bias, added before the rounding as the twin's F.linear does
        bias = bias_ptr + expert * stride_be
        gate += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(bias + inter + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + slot * inter + n, gated_product(gate, up, alpha, limit, out_ptr, CLAMPED), mask=n_ok)


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, ids_ptr, weight_ptr, out_ptr, bias_ptr, hidden, inter, stride_we, stride_wn, stride_be,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BIAS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        rows = w_ptr + expert * stride_we + n.to(tl.int64) * stride_wn
        down = _row_products(h_ptr + slot * inter, rows, n_ok, inter, BLOCK_N, BLOCK_K)
        if BIAS:
            down += tl.load(bias_ptr + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        routed = down.to(dtype).to(tl.float32) * tl.load(weight_ptr + slot)
        total += routed.to(dtype).to(tl.float32)
    tl.store(out_ptr + n, total.to(dtype), mask=n_ok)


def one_token_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    gating: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """`reference.fused_moe` of one token: x [1, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights
    float32 [1, k], ids [1, k] (distinct experts), optional biases and gpt-oss's gating; [1, H]."""
    tokens, hidden = x.shape
    assert tokens == 1 and ids.shape[0] == 1
    inter, top_k = w_down.shape[2], ids.shape[1]
    bias_gate_up, bias_down, alpha, limit = kernel_operands(x, w_gate_up, w_down, biases, gating)
    small = interpreting()
    gate_up_launch = INTERPRETER_LAUNCH if small else GATE_UP_LAUNCH
    down_launch = INTERPRETER_LAUNCH if small else DOWN_LAUNCH
    flat_ids = ids.reshape(top_k)
    gated = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(top_k, triton.cdiv(inter, gate_up_launch["block_n"]))](
        x, w_gate_up, flat_ids, gated, bias_gate_up, hidden, inter, w_gate_up.stride(0), w_gate_up.stride(1),
        bias_gate_up.stride(0), alpha, limit, BLOCK_N=gate_up_launch["block_n"], BLOCK_K=gate_up_launch["block_k"],
        BIAS=biases is not None, CLAMPED=gating is not None, num_warps=gate_up_launch["num_warps"], **pdl(x),
    )  # fmt: skip
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(triton.cdiv(hidden, down_launch["block_n"]),)](
        gated, w_down, flat_ids, weights.reshape(top_k).float().contiguous(), out, bias_down, hidden, inter,
        w_down.stride(0), w_down.stride(1), bias_down.stride(0), TOP_K=top_k, BLOCK_N=down_launch["block_n"],
        BLOCK_K=down_launch["block_k"], BIAS=biases is not None, num_warps=down_launch["num_warps"], **pdl(x),
    )  # fmt: skip
    return out
