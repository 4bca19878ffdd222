"""Sparse prefill of one fresh long prompt: estimate each head's pattern, then attend sparsely.

`sparse_prefill(..., use_triton=False)` is the torch twin of the whole path: the same estimation
(in torch) and the same index, then masked dense attention; `use_triton=True` runs the Triton
estimation (last-query statistics and rescue blocks, lastq.py / pooled.py) and the Triton sparse
kernel. Estimation is vectorised over the heads of each pattern kind: one launch per step for the
whole layer, whatever the number of KV heads.
"""

from __future__ import annotations

import torch

from tgserve.kernels import reference
from tgserve.kernels.sparse import estimate
from tgserve.kernels.sparse.boxes import box_rescue_blocks
from tgserve.kernels.sparse.config import KINDS, RESCUE_AGAINST, HeadPattern
from tgserve.kernels.sparse.index import (
    SparseIndex,
    build_index,
    index_to_mask,
    num_blocks,
    window_cover,
)
from tgserve.kernels.sparse.tail import fold_tail, masked_lse, skipped_tail


def _scatter_rows(parts: list[tuple[list[int], torch.Tensor]], rows: int, fill: int) -> torch.Tensor | None:
    """Concatenate per-head-subset tensors along their last dim into `rows` head rows."""
    if not parts:
        return None
    out = []
    for heads, part in parts:
        full = torch.full((rows, *part.shape[1:]), fill, dtype=torch.long, device=part.device)
        full[estimate.head_index(heads, part.device)] = part.long()
        out.append(full)
    return torch.cat(out, dim=-1)


def _keys_rescue(key: torch.Tensor, scale: float, use_triton: bool):
    """The rescue scored against every key: (its function, the keys it reads)."""
    if use_triton:
        from tgserve.kernels.sparse.pooled import rescue_blocks_triton, rescue_keys

        return rescue_blocks_triton, rescue_keys(key)  # quantized once for both launches

    def rescue_of(query, key, heads, *args, query_range=False):
        return estimate.rescue_blocks(query, key, heads, scale, *args, query_range=query_range)

    return rescue_of, key


def _rescue(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], patterns: list[HeadPattern], scale: float,
    block: int, cover: torch.Tensor, listed: torch.Tensor | None, columns: torch.Tensor | None, use_triton: bool,
) -> torch.Tensor:  # fmt: skip
    """[S, Q, K] rescue blocks of `heads`: those the block-mean query picks, then (rescue_range of
    them) those the query block's range bound picks among the blocks still not held. Every head
    here scores alike (`estimate_index` groups them by `rescue_against`)."""
    against = patterns[0].rescue_against
    by_keys, keys = (None, None) if against == "boxes" else _keys_rescue(key, scale, use_triton)
    by_boxes = box_rescue_blocks
    if use_triton and against != "keys":
        from tgserve.kernels.sparse.boxes_kernel import box_rescue_blocks_triton as by_boxes
    mean_of, mean_keys = (by_boxes, key) if against == "boxes" else (by_keys, keys)
    range_of, range_keys = (by_keys, keys) if against == "keys" else (by_boxes, key)
    mean_budget = [p.rescue - p.rescue_range for p in patterns]
    if not any(p.rescue_range for p in patterns):
        return mean_of(query, mean_keys, heads, block, cover, listed, columns, mean_budget)
    if any(mean_budget):
        by_mean = mean_of(query, mean_keys, heads, block, cover, listed, columns, mean_budget)
        held = by_mean if listed is None else torch.cat([listed, by_mean], dim=-1)
    else:  # every rescue block by the range: no mean pass to launch
        by_mean = torch.empty(len(heads), cover.shape[-1], 0, dtype=torch.long, device=query.device)
        held = listed
    by_range = range_of(query, range_keys, heads, block, cover, held, columns, [p.rescue_range for p in patterns],
                        query_range=True)  # fmt: skip
    return torch.cat([by_mean, by_range], dim=-1)


def _block_sparse(
    query: torch.Tensor, key: torch.Tensor, scale: float, heads: list[int], budget: list[int], block: int
) -> torch.Tensor:
    """[S, Q, K] key blocks of block-sparse heads by pooled (block-mean) scores, KV group by group.

    The [G, Q, Q] pooled scores of one group at a time bound memory (256 MiB per head at 512K).
    """
    group = query.shape[1] // key.shape[1]
    nq = num_blocks(query.shape[0], block)
    out = torch.full(
        (len(heads), nq, max(1, min(nq, max(budget)))), -1, dtype=torch.long, device=query.device
    )
    for kv in range(key.shape[1]):
        rows = [i for i, h in enumerate(heads) if h // group == kv]
        if rows:
            q = query[:, [heads[i] for i in rows]]
            scores = estimate.force_blocks(estimate.pooled_mean_scores(q, key[:, kv], scale, block))
            picks = estimate.top_blocks(scores, [budget[i] for i in rows])
            out[estimate.head_index(rows, query.device), :, : picks.shape[-1]] = picks
    return out


def estimate_index(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    key: torch.Tensor,  # [n, num_kv_heads, head_dim]
    scale: float,
    patterns: list[HeadPattern],
    block: int = 64,
    last_q: int = 64,
    use_triton: bool = False,
) -> SparseIndex:
    """Estimate every head's sparse index: block-diagonal cover, listed blocks, key columns."""
    n, num_heads, _ = query.shape
    assert len(patterns) == num_heads, "one pattern per query head"
    nq = num_blocks(n, block)
    device = query.device
    kinds = {kind: [h for h, p in enumerate(patterns) if p.kind == kind] for kind in KINDS}
    cover = torch.zeros(num_heads, nq, dtype=torch.bool, device=device)
    if kinds["dense"]:
        cover[estimate.head_index(kinds["dense"], device)] = True
    cols: list[tuple[list[int], torch.Tensor]] = []
    blocks: list[tuple[list[int], torch.Tensor]] = []
    if a := kinds["a_shape"]:
        local = estimate.host_values([patterns[h].local for h in a], device)
        cover[estimate.head_index(a, device)] = window_cover(local, nq, block)
        sink = max(patterns[h].sink for h in a)
        first = torch.arange(min(sink, n), device=device).expand(len(a), -1)
        limits = estimate.host_values([patterns[h].sink for h in a], device)[:, None]
        cols.append((a, torch.where(first < limits, first, -1)))
    if vs := kinds["vertical_slash"]:
        if use_triton:
            from tgserve.kernels.sparse.lastq import last_q_scores_triton as scores_of
        else:
            scores_of = estimate.vertical_slash_scores
        vertical, diagonal = scores_of(query, key, vs, scale, last_q, block)
        p = [patterns[h] for h in vs]
        cols.append((vs, estimate.top_with_forced(vertical, [x.vertical for x in p], [x.sink for x in p])))
        # Diagonals are selected in block units, the unit the kernel pays for: slash / block
        # block diagonals by captured mass (scattered single diagonals would each cost a block).
        budget = [-(-x.slash // block) for x in p]
        forced = [-(-x.local // block) + 1 for x in p]
        cover[estimate.head_index(vs, device)] = estimate.top_diagonals(diagonal, budget, forced)
    if bs := kinds["block_sparse"]:
        blocks.append((bs, _block_sparse(query, key, scale, bs, [patterns[h].blocks for h in bs], block)))
    rescued = [h for h in kinds["vertical_slash"] + kinds["block_sparse"] if patterns[h].rescue > 0]
    listed, columns = _scatter_rows(blocks, num_heads, -1), _scatter_rows(cols, num_heads, -1)
    for against in RESCUE_AGAINST:  # heads scored against keys, then those against boxes
        if rs := [h for h in rescued if patterns[h].rescue_against == against]:
            at = estimate.head_index(rs, device)
            picks = _rescue(query, key, rs, [patterns[h] for h in rs], scale, block, cover[at],
                            None if listed is None else listed[at], None if columns is None else columns[at],
                            use_triton)  # fmt: skip
            blocks.append((rs, estimate.share_neighbours(picks)))
    return build_index(n, block, cover, _scatter_rows(blocks, num_heads, -1), columns)


def sparse_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    patterns: list[HeadPattern],
    block: int = 64,
    last_q: int = 64,
    use_triton: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal sparse attention of one fresh prompt [n, heads, d]; returns [n, heads, d]."""
    index = estimate_index(query, key, scale, patterns, block, last_q, use_triton)
    tail = None
    if any(p.tail for p in patterns):
        if use_triton:
            from tgserve.kernels.sparse.tail_kernel import skipped_tail_triton as skipped_tail_of
        else:
            skipped_tail_of = skipped_tail
        tail = skipped_tail_of(query, key, value, index, scale, [p.tail for p in patterns])
    if use_triton:
        from tgserve.kernels.sparse.kernel import sparse_attention_kernel

        return sparse_attention_kernel(query, key, value, index, scale, out=out, tail=tail)
    mask = index_to_mask(index)
    result = reference.masked_attention(query, key, value, mask, scale)
    if tail is not None:
        result = fold_tail(result, masked_lse(query, key, mask, scale), tail, block)
    if out is not None:
        out.copy_(result)
        return out
    return result
