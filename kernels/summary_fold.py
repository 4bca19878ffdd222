"""Triton kernel: fold a step's keys into their blocks' key summaries (selective decode attention).

Twin: `reference.update_key_summaries`. A block's keys in one step are one run of
consecutive rows (a block belongs to one sequence, whose rows are its positions in order), so the
program of a run's first row reduces the whole run in registers and stores each of the block's
minimum and maximum once: no atomics. torch's scatter_reduce, which the twin uses, takes an atomic
per key element: at a million-token prompt, 1G of them a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import pdl, wait_for_inputs


@triton.jit
def _fold_kernel(
    key_ptr,
    slot_ptr,
    summary_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_s_side,
    stride_s_block,
    stride_s_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    RUN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    previous = tl.load(slot_ptr + token - 1, mask=token > 0, other=-1)
    # (Integer division truncates in compiled Triton and floors in the interpreter: divide only slots >= 0.)
    block = tl.where(slot >= 0, slot // BLOCK_SIZE, -1)
    previous_block = tl.where(previous >= 0, previous // BLOCK_SIZE, -1)
    if (slot >= 0) & (previous_block != block):  # the first row of its block's run
        rows = token + tl.arange(0, RUN)  # a run has at most BLOCK_SIZE rows
        slots = tl.load(slot_ptr + rows, mask=rows < num_tokens, other=-1)
        in_run = (slots >= 0) & (tl.where(slots >= 0, slots // BLOCK_SIZE, -1) == block)
        # The block's first slot written this step: it was free or held another sequence's keys.
        fresh = tl.max((in_run & (slots % BLOCK_SIZE == 0)).to(tl.int32), 0) > 0
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        mask = in_run[:, None] & dim_ok[None, :]
        row_ptrs = key_ptr + rows.to(tl.int64)[:, None] * stride_kt + dims[None, :]
        at = summary_ptr + block.to(tl.int64) * stride_s_block + dims
        for head in range(num_kv_heads):
            # Rounded to the summary's dtype first, as the twin does (rounding keeps the order).
            keys = tl.load(row_ptrs + head * stride_kh, mask=mask, other=0.0)
            keys = keys.to(summary_ptr.dtype.element_ty).to(tl.float32)
            low = tl.min(tl.where(mask, keys, float("inf")), 0)
            high = tl.max(tl.where(mask, keys, float("-inf")), 0)
            head_at = at + head * stride_s_head
            if not fresh:
                low = tl.minimum(low, tl.load(head_at, mask=dim_ok, other=0.0).to(tl.float32))
                high = tl.maximum(
                    high, tl.load(head_at + stride_s_side, mask=dim_ok, other=0.0).to(tl.float32)
                )
            tl.store(head_at, low.to(summary_ptr.dtype.element_ty), mask=dim_ok)
            tl.store(head_at + stride_s_side, high.to(summary_ptr.dtype.element_ty), mask=dim_ok)


def fold_key_summaries(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1: not stored
    key_summary: torch.Tensor,  # [2, num_blocks, num_kv_heads, head_dim]
    block_size: int,
) -> None:
    """`update_key_summaries` in one launch: each block's run of rows reduced by one program."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and key_summary.stride(3) == 1
    _fold_kernel[(num_tokens,)](
        key,
        slot_mapping,
        key_summary,
        num_tokens,
        key.stride(0),
        key.stride(1),
        key_summary.stride(0),
        key_summary.stride(1),
        key_summary.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        RUN=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=2,
        **pdl(key),
    )
