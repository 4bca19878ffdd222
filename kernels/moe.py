"""Triton mixture-of-experts: two grouped GEMMs over a step's rows grouped by expert.

Twin: `reference.fused_moe`. The step's (token, slot) assignments are laid out expert by expert in
blocks of BLOCK_M rows (`moe_routing.expert_blocks`); a program takes one block and a tile of
output columns, and reads only its block's expert's weights, so a decode step reads the experts
its rows chose and no other (Qwen3-30B-A3B: 8 of 128 a token). The first GEMM gathers the block's
token rows and computes gate and up together, storing silu(gate) * up; the second multiplies by
the expert's down projection, scales each row by its routing weight and stores it at its
assignment; the k assignments of a token are summed after. Unused blocks (the layout has room for
every expert's last partial block) return at once: the grid depends on the row count alone, so a
decode step can be replayed from a CUDA graph.

Rounding follows the twin's op boundaries: gate and up are rounded to the input dtype before the
gating, the gated product and the down projection's output too. gpt-oss's experts add a bias to
each projection (before that rounding) and gate with `moe_routing.ClampedSwiGLU`, computed in
float32 (the twin rounds each of its ops in half precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.moe_common import gated_product, kernel_operands
from tgserve.kernels.moe_routing import ClampedSwiGLU, expert_blocks
from tgserve.kernels.triton_common import dot_precision, interpreting

# Rows a block: decode steps have a few rows an expert (16: tl.dot's least), prompt steps many.
# (BLOCK_N, BLOCK_K, warps, stages) for both GEMMs, prompt steps and decode steps (blocks of
# SMALL_BLOCK_M rows): a decode step reads each chosen expert's weights once and is bound by how
# many bytes are in flight, so its tiles are `kernels/bench/bench_moe.py`'s to choose.
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
LAUNCH = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
# Decode: narrower, deeper tiles (more programs, more bytes in flight); on an H100 0.88-0.93x
# the prompt's tiles' time for Qwen3-30B-A3B, Mixtral and gpt-oss at batch 1
# (docs/benchmarks/2026-12-05-glue-and-moe-tiles-h100.md).
DECODE_LAUNCH = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 3}
# One token's experts as GEMVs (`moe_decode.py`) instead of 16-row blocks for tl.dot: on an H100
# 0.85x the grouped kernels' time for Qwen3-30B-A3B's experts, 0.79x for Mixtral's and gpt-oss's;
# batch-1 decode -3.5%, -6.9% and -4.4% (docs/benchmarks/2026-12-06-moe-one-token-gemv-h100.md).
ONE_TOKEN_GEMV = True


def block_rows(assignments: int, num_experts: int) -> int:
    """BLOCK_M for a step: small where experts get a few rows each on average."""
    if interpreting() or assignments <= 4 * num_experts:
        return SMALL_BLOCK_M
    return LARGE_BLOCK_M


@triton.jit
def _block_tile(rows_ptr, w_ptr, expert, stride_we, n_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block rows (layout positions m, assignments row, -1 padding) and output
    columns n, and its expert's weights."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + m)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return m, row, row >= 0, n, n < n_size, w_ptr + expert.to(tl.int64) * stride_we


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, rows_ptr, expert_ptr, out_ptr, bias_ptr, hidden, inter, top_k, stride_xt, stride_we, stride_wn,
    stride_ot, stride_be, alpha, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
):  # fmt: skip
    expert = tl.load(expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    m, row, used, n, n_ok, w_base = _block_tile(rows_ptr, w_ptr, expert, stride_we, inter, BLOCK_M, BLOCK_N)
    token = tl.where(used, row // top_k, 0).to(tl.int64)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(
            x_ptr + token[:, None] * stride_xt + k[None, :], mask=used[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None], mask=w_mask, other=0.0)
        up = tl.load(
            w_base + (inter + n)[None, :].to(tl.int64) * stride_wn + k[:, None], mask=w_mask, other=0.0
        )
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    if BIAS:  # gpt-oss: each projection's bias, added before the rounding as the twin's F.linear does
        bias = bias_ptr + expert.to(tl.int64) * stride_be
        acc_gate += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    gated = gated_product(acc_gate, acc_up, alpha, limit, out_ptr, CLAMPED)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_ot + n[None, :], gated, mask=n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, rows_ptr, expert_ptr, weight_ptr, out_ptr, bias_ptr, hidden, inter, stride_ht, stride_we,
    stride_wn, stride_ot, stride_be, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, BIAS: tl.constexpr = False,
):  # fmt: skip
    expert = tl.load(expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    m, row, used, n, n_ok, w_base = _block_tile(rows_ptr, w_ptr, expert, stride_we, hidden, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(h_ptr + m[:, None].to(tl.int64) * stride_ht + k[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[
            None, :
        ]
    dtype = out_ptr.dtype.element_ty
    routed = acc.to(dtype).to(tl.float32) * tl.load(weight_ptr + row, mask=used, other=0.0)[:, None]
    at = tl.where(used, row, 0).to(tl.int64)
    tl.store(
        out_ptr + at[:, None] * stride_ot + n[None, :], routed.to(dtype), mask=used[:, None] & n_ok[None, :]
    )


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    gating: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """`reference.fused_moe` in two grouped GEMMs: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I],
    weights float32 [T, k], ids [T, k], optional biases (gate_up [E, 2I], down [E, H]) and gpt-oss's
    gating; returns [T, H] in x's dtype."""
    tokens, hidden = x.shape
    if ONE_TOKEN_GEMV and tokens == 1:
        from tgserve.kernels.moe_decode import one_token_moe

        return one_token_moe(x, w_gate_up, w_down, weights, ids, biases, gating)
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    top_k = ids.shape[1]
    bias_gate_up, bias_down, alpha, limit = kernel_operands(x, w_gate_up, w_down, biases, gating)
    block_m = block_rows(tokens * top_k, num_experts)
    layout = expert_blocks(ids, num_experts, block_m)
    small = interpreting()
    tiles = DECODE_LAUNCH if block_m == SMALL_BLOCK_M else LAUNCH
    block_n = 16 if small else tiles["block_n"]
    block_k = 16 if small else tiles["block_k"]
    launch = {} if small else {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]}
    common = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype), **launch
    )
    gated = torch.empty(layout.rows.shape[0], inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(layout.num_blocks, triton.cdiv(inter, block_n))](
        x, w_gate_up, layout.rows, layout.block_expert, gated, bias_gate_up, hidden, inter, top_k, x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), gated.stride(0), bias_gate_up.stride(0), alpha, limit,
        BIAS=biases is not None, CLAMPED=gating is not None, **common,
    )  # fmt: skip
    routed = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(layout.num_blocks, triton.cdiv(hidden, block_n))](
        gated, w_down, layout.rows, layout.block_expert, weights.float().contiguous(), routed, bias_down, hidden,
        inter, gated.stride(0), w_down.stride(0), w_down.stride(1), routed.stride(0), bias_down.stride(0),
        BIAS=biases is not None, **common,
    )  # fmt: skip
    return routed.view(tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
