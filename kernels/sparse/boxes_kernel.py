"""Triton rescue against key-block boxes: each query block's bound against every causal key block's
box, and the top blocks a pattern does not hold yet, for every listed head in one launch.

Twin: `boxes.box_rescue_blocks` (the bounds are explained in boxes.py). The work is [Q, Q]
products of width 2d (the mean query) or 4d (the range), 1/16 to 1/32 of the keys' pass
(`pooled.py`, [Q, n] products), so the product is not what costs most here. A program walks
BLOCK_K key blocks a step and merges a step's scores into each row's top-R by repeatedly taking
the row's best remaining score while it beats the row's weakest kept one: after the first steps
fill the slots, most steps merge nothing or one block, where the keys' pass pays a merge for every
key block.

Measured on an H100 (Llama-3-8B's 32 / 8 heads, range pass, one layer): 2.9 ms a call at 128K, of
which this kernel 0.69, the block ranges of queries and keys (torch reductions over every head)
1.23, the column boxes 0.32; 17.8 ms at 512K, the kernel 9.8 (it grows with the square of the prompt, the
rest linearly). Against keys the same pass costs 5.3 and 54 ms (2026-12-06-rescue-by-boxes-triton-h100.md).

Before the launch, each listed head's boxes: its KV head's boxes (`estimate.block_ranges`, exact),
then the blocks holding one of the head's columns taken again from their keys less the columns by
`_column_boxes_kernel` (one program a column: a block of several columns is written alike by each).

Operands are float32 from float32 inputs (exact tests) and the inputs' 16-bit type otherwise,
products accumulated in float32; the twin rounds its operands the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.sparse.boxes import box_dtype
from tgserve.kernels.sparse.estimate import (
    block_means,
    block_ranges,
    column_keys,
    head_index,
    host_values,
    range_rows,
)
from tgserve.kernels.sparse.pooled import BITS, listed_bitmap, program_tile, top_picks
from tgserve.kernels.triton_common import dot_precision, interpreting, pow2

# GPU launch; key_blocks: key blocks a step (the width of a step's products and merge). H100 sweep
# (block_r 32-128, key_blocks 16-64, 4 or 8 warps): 3.08-5.56 ms at 128K, this one 3.15; 64 key
# blocks a step were 6% faster at 512K (16.7 against 17.8 ms), not yet run through the GPU tests.
LAUNCH = {"block_r": 64, "key_blocks": 32, "num_warps": 4, "num_stages": 2}
INTERPRETER_LAUNCH = {"block_r": 16, "key_blocks": 16, "num_warps": 4, "num_stages": 2}  # tl.dot's least


@triton.jit(do_not_specialize=["n", "num_qb", "num_columns"])
def _column_boxes_kernel(
    key_ptr, kv_ptr, columns_ptr, skip_ptr, mid_ptr, radius_ptr,
    n, num_qb, num_columns, head_dim, stride_kt, stride_kh,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (listed head s, column c): the box of the key block holding column c from its keys
    less head s's columns (skip: per-key flags [S, n]); an empty block gets midpoint and
    half-width 0."""
    s = tl.program_id(0)
    column = tl.load(columns_ptr + s.to(tl.int64) * num_columns + tl.program_id(1))
    if (column >= 0) & (column < n):
        kv = tl.load(kv_ptr + s)
        pos = (column // BLOCK) * BLOCK + tl.arange(0, BLOCK)
        dims = tl.arange(0, BLOCK_D)
        keep = (pos < n) & (tl.load(skip_ptr + s.to(tl.int64) * n + pos, mask=pos < n, other=1) == 0)
        at = key_ptr + kv.to(tl.int64) * stride_kh + pos.to(tl.int64)[:, None] * stride_kt + dims[None, :]
        keys = tl.load(at, mask=keep[:, None] & (dims < head_dim)[None, :], other=0.0).to(tl.float32)
        high = tl.max(tl.where(keep[:, None], keys, float("-inf")), 0)
        low = tl.min(tl.where(keep[:, None], keys, float("inf")), 0)
        any_kept = tl.max(keep.to(tl.int32), 0) > 0
        high, low = tl.where(any_kept, high, 0.0), tl.where(any_kept, low, 0.0)
        out = (s.to(tl.int64) * num_qb + column // BLOCK) * head_dim + dims
        dim_ok = dims < head_dim
        tl.store(mid_ptr + out, ((high + low) / 2).to(mid_ptr.dtype.element_ty), mask=dim_ok)
        tl.store(radius_ptr + out, ((high - low) / 2).to(radius_ptr.dtype.element_ty), mask=dim_ok)


def head_boxes(
    key: torch.Tensor, kv_of: list[int], block: int, columns: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """([S, Q, d], [S, Q, d]) in dtype: for each listed head (reading KV head kv_of[s]) its key
    blocks' box midpoints and half-widths, less its columns: `boxes.key_boxes` rounded to dtype."""
    n, _, head_dim = key.shape
    high, low = (x.float() for x in block_ranges(key, block))  # [Q, Hkv, d]: exact
    kv = host_values(kv_of, key.device)
    mid = ((high + low) / 2).to(dtype).transpose(0, 1)[kv].contiguous()  # [S, Q, d]
    radius = ((high - low) / 2).to(dtype).transpose(0, 1)[kv].contiguous()
    if columns is not None:
        skip = column_keys(columns, n).to(torch.int8)  # [S, n]: each head's columns
        columns = columns.to(torch.int32).contiguous()
        assert key.stride(2) == 1
        _column_boxes_kernel[(len(kv_of), columns.shape[1])](
            key, kv, columns, skip, mid, radius, n, mid.shape[1], columns.shape[1], head_dim,
            key.stride(0), key.stride(1), BLOCK=block, BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return mid, radius


@triton.jit
def _merge_top(best_v, best_i, scores, first, slots, cols):
    """best_v/best_i [R, T] (each row's kept scores and key blocks) with the step's scores
    [R, K] (key blocks first + cols) merged in: the row's best remaining score replaces its
    weakest kept one while it beats it, so a step costs one pass per block that gets in."""
    top = tl.max(scores, 1)
    at = tl.argmax(scores, 1)
    enters = top > tl.min(best_v, 1)
    while tl.max(enters.to(tl.int32), 0) > 0:
        weakest = tl.argmin(best_v, 1)
        hit = (slots[None, :] == weakest[:, None]) & enters[:, None]
        best_v = tl.where(hit, top[:, None], best_v)
        best_i = tl.where(hit, (first + at)[:, None], best_i)
        scores = tl.where((cols[None, :] == at[:, None]) & enters[:, None], float("-inf"), scores)
        top = tl.max(scores, 1)
        at = tl.argmax(scores, 1)
        enters = top > tl.min(best_v, 1)
    return best_v, best_i


# Lengths and counts unspecialised, as kernel.LENGTH_ARGS: every prompt length shares one compile.
@triton.jit(do_not_specialize=["num_qb", "num_tiles", "num_rows", "words"])
def _box_rescue_kernel(
    qa_ptr, qb_ptr, mid_ptr, radius_ptr, cover_ptr, bits_ptr, val_ptr, idx_ptr,
    num_qb, num_tiles, num_rows, head_dim, words,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr,
    HAS_BITS: tl.constexpr, PRECISION: tl.constexpr, RANGE: tl.constexpr,
):  # fmt: skip
    """Program (tile of BLOCK_R query blocks, listed head): the top-R key blocks by the bound
    a . m + |a| . r (+ b . |m| + b . r with RANGE) of each query block (a: its mean query or range
    midpoint, b: its range half-width) against each causal key block's box (m, r), held blocks
    (cover: block diagonals by offset; bits: listed blocks) left out."""
    tile, _row, qb, row_ok, dims, dim_ok, base = program_tile(
        num_tiles, num_rows, num_qb, head_dim, BLOCK_R, BLOCK_D
    )
    q_at = (base + qb)[:, None] * head_dim + dims[None, :]
    a = tl.load(qa_ptr + q_at, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    a_magnitude = tl.abs(a)
    b = a  # unread without RANGE
    if RANGE:
        b = tl.load(qb_ptr + q_at, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    cols = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, R)
    best_v = tl.full([BLOCK_R, R], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_R, R], -1, tl.int32)
    last = tl.minimum(num_qb - 1, tile * BLOCK_R + BLOCK_R - 1)
    for j0 in range(0, last + 1, BLOCK_K):
        j = j0 + cols
        box_at = (base + j)[:, None] * head_dim + dims[None, :]
        box_ok = (j <= last)[:, None] & dim_ok[None, :]
        m = tl.load(mid_ptr + box_at, mask=box_ok, other=0.0)
        r = tl.load(radius_ptr + box_at, mask=box_ok, other=0.0)
        s = tl.dot(a, tl.trans(m), input_precision=PRECISION)
        s += tl.dot(a_magnitude, tl.trans(r), input_precision=PRECISION)
        if RANGE:
            s += tl.dot(b, tl.trans(tl.abs(m)), input_precision=PRECISION)
            s += tl.dot(b, tl.trans(r), input_precision=PRECISION)
        visible = row_ok[:, None] & (qb[:, None] >= j[None, :])
        held = tl.load(cover_ptr + base + qb[:, None] - j[None, :], mask=visible, other=1)
        if HAS_BITS:
            word = tl.load(bits_ptr + (base + qb)[:, None] * words + j[None, :] // 16, mask=visible, other=0)
            held = held | ((word >> (j[None, :] % 16)) & 1).to(tl.int8)
        s = tl.where(visible & (held == 0), s, float("-inf"))
        best_v, best_i = _merge_top(best_v, best_i, s, j0, slots, cols)
    out = (base + qb)[:, None] * R + slots[None, :]
    tl.store(val_ptr + out, best_v, mask=row_ok[:, None])
    tl.store(idx_ptr + out, best_i, mask=row_ok[:, None])


def _query_operands(
    query: torch.Tensor, heads: list[int], block: int, query_range: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, Q, d] each: the range's midpoints and half-widths, or the mean queries (twice), in dtype."""
    at = head_index(heads, query.device)
    if query_range:
        mid, radius = (x[at].to(dtype).contiguous() for x in range_rows(query, block))
        return mid, radius
    mean = block_means(query, block)[:, at].transpose(0, 1).to(dtype).contiguous()
    return mean, mean


def box_rescue_blocks_triton(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], block: int, cover: torch.Tensor,
    listed: torch.Tensor | None, columns: torch.Tensor | None, budget: list[int], query_range: bool = False,
) -> torch.Tensor:  # fmt: skip
    """[S, Q, K] rescue key blocks of the listed query heads by box bounds: the interface and the
    picks of `boxes.box_rescue_blocks`."""
    head_dim = query.shape[-1]
    group = query.shape[1] // key.shape[1]
    nq, rows, device = cover.shape[-1], len(heads), query.device
    width = max(1, min(nq, max(budget)))
    top_r = max(2, triton.next_power_of_2(width))
    dtype = box_dtype(query)
    mid, radius = head_boxes(key, [h // group for h in heads], block, columns, dtype)
    qa, qb = _query_operands(query, heads, block, query_range, dtype)
    cover8 = cover.to(torch.int8).contiguous()
    bits = cover8 if listed is None else listed_bitmap(listed, nq)
    values = torch.empty(rows, nq, top_r, dtype=torch.float32, device=device)
    index = torch.empty(rows, nq, top_r, dtype=torch.int32, device=device)
    launch = INTERPRETER_LAUNCH if interpreting() else LAUNCH
    tiles = triton.cdiv(nq, launch["block_r"])
    _box_rescue_kernel[(tiles * rows,)](
        qa, qb, mid, radius, cover8, bits, values, index, nq, tiles, rows, head_dim, -(-nq // BITS),
        BLOCK_R=launch["block_r"], BLOCK_K=launch["key_blocks"], BLOCK_D=pow2(head_dim), R=top_r,
        HAS_BITS=listed is not None, PRECISION=dot_precision(dtype), RANGE=query_range,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )  # fmt: skip
    return top_picks(values, index, width, budget)
