"""Rescue blocks chosen by key-block boxes: a query block's bound against each key block's box.

The rescue (`estimate.rescue_blocks`, `pooled.rescue_blocks_triton`) scores a query block's mean
query, or its range bound, against every key and max-pools per key block: [Q, n] products, which
grow with the square of the prompt (at 512K on an H100 the two passes are ~88 ms of a layer's
~165). Here the keys of each key block are summarised first by their box, the per-coordinate
largest and smallest value (less the head's columns, which pass 2 attends anyway), and a query
block is scored against boxes: [Q, Q] products at 2-4x the width, 1/32 to 1/16 of the work.

For a query q and the box of keys k with midpoint m and half-width r (per coordinate), the largest
q . k over the box is q . m + |q| . r: the mean query's bound. For the query block's own box
(midpoint a, half-width b, `estimate.range_rows`), the largest over both boxes is at most
a . m + |a| . r + b . |m| + b . r: the range bound, which keeps the whole logit of a key that a
few of the block's queries seek (a needle). Each is one product of concatenated operands:
[a, |a|, b, b] . [m, r, |m|, r]. A box bound is at least the max-pooled score of the same query
side, so a block holding one salient key still ranks high; a block of keys spread along the query
ranks higher than its best key would (the box is loose). On structured prompts the range bound
against boxes kept every needle the keys' pass kept, and more; the mean query against boxes
ranked far diagonals' blocks worse (rotating coordinates give every block a wide box), so the
default pattern, "range-boxes", scores only the range against boxes, and the mean against boxes
only past `SparseConfig.mean_keys_max_len`, where the mean's pass against keys costs seconds
(docs/benchmarks/2026-12-06-rescue-by-boxes-cpu.md, 2026-12-06-rescue-by-boxes-triton-h100.md).

This is the torch twin of `boxes_kernel.box_rescue_blocks_triton` (the CPU path and the
reference): operands rounded to the kernel's type (float32, or the inputs' 16-bit type), products
in float32, the scores of every head in chunks of query blocks (256 MiB each).
"""

from __future__ import annotations

import torch

from tgserve.kernels.sparse.estimate import (
    block_means,
    block_ranges,
    column_keys,
    held_blocks,
    range_rows,
    top_blocks,
)

CHUNK_SCORES = 1 << 26  # float32 scores a chunk of query blocks holds, all heads: 256 MiB


def box_dtype(query: torch.Tensor) -> torch.dtype:
    """The operands' type: float32 for float32 inputs (exact tests), else the inputs' 16-bit type
    (ranking only, within a row; products accumulate in float32)."""
    return torch.float32 if query.dtype == torch.float32 else query.dtype


def key_boxes(
    key: torch.Tensor, kv_of: list[int], columns: torch.Tensor | None, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ([S, Q, d], [S, Q, d]): for each listed query head (reading KV head kv_of[s] of key
    [n, Hkv, d]), each key block's per-coordinate midpoint and half-width of its keys, less the
    head's columns (columns [S, C], -1 = none). A block of columns alone gets an empty box
    (midpoint and half-width 0: scores 0, below any salient block).

    The boxes of every KV head are taken once; only the blocks that hold one of a head's columns
    are taken again for it, from their keys less the columns."""
    n = key.shape[0]
    high, low = (x.transpose(0, 1)[kv_of].float() for x in block_ranges(key, block))  # [S, Q, d] each
    if columns is not None:
        skips = column_keys(columns, n)  # [S, n]
        within = torch.arange(block, device=key.device)
        for s, kv in enumerate(kv_of):
            at = torch.where((columns[s] >= 0) & (columns[s] < n), columns[s].long() // block, 0)  # [C]
            positions = (at[:, None] * block + within).clamp(max=n - 1)  # [C, block]
            keys = key[positions, kv].float()  # [C, block, d]
            out = (skips[s][positions] | (at[:, None] * block + within >= n))[..., None]
            high[s, at] = keys.masked_fill(out, float("-inf")).amax(1)
            low[s, at] = keys.masked_fill(out, float("inf")).amin(1)
        empty = torch.isinf(high)
        high, low = high.masked_fill(empty, 0.0), low.masked_fill(empty, 0.0)
    return (high + low) / 2, (high - low) / 2


def bound_operands(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], block: int, columns: torch.Tensor | None,
    query_range: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """float32 ([S, Q, m], [S, Q, m]) whose product, query block by key block, is the bound: the
    mean query [q, |q|] against [box midpoint, half-width] (m = 2d), or the query block's range
    [a, |a|, b, b] against [midpoint, half-width, |midpoint|, half-width] (m = 4d)."""
    group = query.shape[1] // key.shape[1]
    box_mid, box_radius = key_boxes(key, [h // group for h in heads], columns, block)
    if query_range:
        mid, radius = range_rows(query[:, heads], block)  # [S, Q, d]
        queries = torch.cat([mid, mid.abs(), radius, radius], dim=-1)
        return queries, torch.cat([box_mid, box_radius, box_mid.abs(), box_radius], dim=-1)
    mean = block_means(query[:, heads], block).transpose(0, 1)  # [S, Q, d]
    return torch.cat([mean, mean.abs()], dim=-1), torch.cat([box_mid, box_radius], dim=-1)


def box_rescue_blocks(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], block: int, cover: torch.Tensor,
    listed: torch.Tensor | None, columns: torch.Tensor | None, budget: list[int], query_range: bool = False,
) -> torch.Tensor:  # fmt: skip
    """[S, Q, K] rescue key blocks of the listed query heads by box bounds; the interface of
    `estimate.rescue_blocks` (query [n, H, d], key [n, Hkv, d], cover bool [S, Q], listed [S, Q, b]
    and columns [S, C] with -1 for none, K = max(budget))."""
    nq, device = cover.shape[-1], query.device
    width = max(1, min(nq, max(budget)))  # top_blocks' width
    dtype = box_dtype(query)
    queries, boxes = bound_operands(query, key, heads, block, columns, query_range)
    # Operands rounded as the kernel's, products in float32: [S, Q, m], [S, m, Q].
    queries, boxes = queries.to(dtype).float(), boxes.to(dtype).float().transpose(1, 2)
    out = torch.empty(len(heads), nq, width, dtype=torch.long, device=device)
    chunk = max(1, CHUNK_SCORES // (nq * len(heads)))
    keys = torch.arange(nq, device=device)
    for r0 in range(0, nq, chunk):
        rows = slice(r0, min(nq, r0 + chunk))
        scores = torch.bmm(queries[:, rows], boxes).float()  # [S, R, Q]
        after = keys[None, :] > keys[rows, None]  # key blocks past the query block
        out[:, rows] = top_blocks(scores, budget, exclude=held_blocks(cover, listed, rows) | after)
    return out
