"""Sparse prefill of one fresh long prompt: estimate each head's pattern, then attend sparsely.

`sparse_prefill(..., use_triton=False)` is the torch twin of the whole path: the same estimation
(in torch) and the same index, then masked dense attention; `use_triton=True` runs the Triton
pooled-max estimate and the Triton sparse kernel.
"""

from __future__ import annotations

import torch

from tgserve.kernels import reference
from tgserve.kernels.sparse import estimate
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.index import (
    SparseIndex,
    build_index,
    index_to_mask,
    num_blocks,
    window_cover,
)


def _scatter_rows(parts: list[tuple[list[int], torch.Tensor]], rows: int, fill: int) -> torch.Tensor | None:
    """Concatenate per-head-subset tensors along their last dim into `rows` head rows."""
    if not parts:
        return None
    out = []
    for heads, part in parts:
        full = torch.full((rows, *part.shape[1:]), fill, dtype=torch.long, device=part.device)
        full[heads] = part.long()
        out.append(full)
    return torch.cat(out, dim=-1)


def _group_parts(
    q: torch.Tensor, k: torch.Tensor, scale: float, patterns: list[HeadPattern], block: int, last_q: int,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Pattern parts of the query heads sharing one KV head: cover [G, Q], blocks, columns."""
    n, group = q.shape[0], q.shape[1]
    nq = num_blocks(n, block)
    device = q.device
    cover = torch.zeros(group, nq, dtype=torch.bool, device=device)
    cols: list[tuple[list[int], torch.Tensor]] = []
    blocks: list[tuple[list[int], torch.Tensor]] = []
    kinds = {kind: [g for g, p in enumerate(patterns) if p.kind == kind] for kind in
             ("dense", "a_shape", "vertical_slash", "block_sparse")}  # fmt: skip
    cover[kinds["dense"]] = True
    if a := kinds["a_shape"]:
        local = estimate.host_values([patterns[g].local for g in a], device)
        cover[a] = window_cover(local, nq, block)
        sink = max(patterns[g].sink for g in a)
        first = torch.arange(min(sink, n), device=device).expand(len(a), -1)
        limits = estimate.host_values([patterns[g].sink for g in a], device)[:, None]
        cols.append((a, torch.where(first < limits, first, -1)))
    if vs := kinds["vertical_slash"]:
        vertical, slash = estimate.last_q_stats(q[:, vs], k, scale, last_q)
        p = [patterns[g] for g in vs]
        cols.append((vs, estimate.top_with_forced(vertical, [x.vertical for x in p], [x.sink for x in p])))
        # Diagonals are selected in block units, the unit the kernel pays for: slash / block
        # block diagonals by captured mass (scattered single diagonals would each cost a block).
        scores = estimate.block_diagonal_scores(slash, block)
        budget = [-(-x.slash // block) for x in p]
        forced = [-(-x.local // block) + 1 for x in p]
        cover[vs] = estimate.top_diagonals(scores, budget, forced)
    if bs := kinds["block_sparse"]:
        scores = estimate.force_blocks(estimate.pooled_mean_scores(q[:, bs], k, scale, block))
        blocks.append((bs, estimate.top_blocks(scores, [patterns[g].blocks for g in bs])))
    if rs := [g for g in kinds["vertical_slash"] + kinds["block_sparse"] if patterns[g].rescue > 0]:
        listed = _scatter_rows(blocks, group, -1)
        columns = _scatter_rows(cols, group, -1)
        blocks.append((rs, _rescue(q[:, rs], k, scale, block, cover[rs],
                                   None if listed is None else listed[rs],
                                   None if columns is None else columns[rs],
                                   [patterns[g].rescue for g in rs], use_triton)))  # fmt: skip
    return cover, _scatter_rows(blocks, group, -1), _scatter_rows(cols, group, -1)


def _rescue(
    q: torch.Tensor, k: torch.Tensor, scale: float, block: int, cover: torch.Tensor,
    listed: torch.Tensor | None, columns: torch.Tensor | None, budget: list[int], use_triton: bool,
) -> torch.Tensor:  # fmt: skip
    """Top key blocks by pooled-max score among keys and blocks the pattern does not hold yet."""
    n = q.shape[0]
    skip = None
    if columns is not None:
        skip = torch.zeros(q.shape[1], n + 1, dtype=torch.bool, device=q.device)
        skip.scatter_(1, torch.where(columns >= 0, columns, n), True)
        skip = skip[:, :n]
    if use_triton:
        from tgserve.kernels.sparse.pooled import pooled_max_scores_triton

        scores = pooled_max_scores_triton(q, k, scale, block, skip)
    else:
        scores = estimate.pooled_max_scores(q, k, scale, block, skip)
    nq = scores.shape[-1]
    i = torch.arange(nq, device=q.device)
    held = cover[:, (i[:, None] - i[None, :]).clamp(min=0)]  # [G, Q, Q] block diagonal held
    if listed is not None:
        taken = torch.zeros(*held.shape[:2], nq + 1, dtype=torch.bool, device=q.device)
        taken.scatter_(2, torch.where(listed >= 0, listed, nq), True)
        held |= taken[..., :nq]
    picks = estimate.top_blocks(scores, budget, exclude=held)  # [G, Q, r]
    # Neighbouring query blocks share their picks: a run of queries seeking one key rarely
    # aligns with block edges, and an edge block's mean query is diluted by the others in it.
    before = torch.nn.functional.pad(picks[:, :-1], (0, 0, 1, 0), value=-1)
    after = torch.nn.functional.pad(picks[:, 1:], (0, 0, 0, 1), value=-1)
    return torch.cat([picks, before, after], dim=-1)


def _pad_cat(parts: list[torch.Tensor | None], rows: list[int], fill: int) -> torch.Tensor | None:
    """Stack per-group [G, ..., w] tensors along heads, padding widths to the widest (None = empty)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    width, like = max(p.shape[-1] for p in present), present[0]
    padded = []
    for p, r in zip(parts, rows):
        p = like.new_full((r, *like.shape[1:-1], width), fill) if p is None else p
        padded.append(torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=fill))
    return torch.cat(padded)


def estimate_index(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    key: torch.Tensor,  # [n, num_kv_heads, head_dim]
    scale: float,
    patterns: list[HeadPattern],
    block: int = 64,
    last_q: int = 64,
    use_triton: bool = False,
) -> SparseIndex:
    """Estimate every head's sparse index; KV head by KV head to bound estimation memory."""
    n, num_heads, _ = query.shape
    num_kv = key.shape[1]
    group = num_heads // num_kv
    assert len(patterns) == num_heads, "one pattern per query head"
    covers, blocks, cols = [], [], []
    for h in range(num_kv):
        sl = slice(h * group, (h + 1) * group)
        c, b, col = _group_parts(query[:, sl], key[:, h], scale, patterns[sl], block, last_q, use_triton)
        covers.append(c)
        blocks.append(b)
        cols.append(col)
    rows = [group] * num_kv
    return build_index(n, block, torch.cat(covers), _pad_cat(blocks, rows, -1), _pad_cat(cols, rows, -1))


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
    if use_triton:
        from tgserve.kernels.sparse.kernel import sparse_attention_kernel

        return sparse_attention_kernel(query, key, value, index, scale, out=out)
    result = reference.masked_attention(query, key, value, index_to_mask(index), scale)
    if out is not None:
        out.copy_(result)
        return out
    return result
