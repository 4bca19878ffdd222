"""Online estimation of sparse indices in torch ops (no host sync): the twins of lastq.py/pooled.py.

The per-group functions work on the query heads that share ONE KV head (grouped-query natively:
the group's queries are stacked against their key, which is never repeated), shapes q [n, G, d],
k [n, d]; `vertical_slash_scores` and `rescue_blocks` take the whole layer ([n, H, d] queries,
[n, Hkv, d] keys, a list of query heads) and loop over heads to bound memory. On CUDA the
attention path calls their Triton versions instead, which never hold an [L, n] or [Q, Q] matrix.
"""

from __future__ import annotations

import torch

from tgserve.kernels.fp8_format import quantize_rows, tensor_scale


def host_values(values: list[int], device: torch.device) -> torch.Tensor:
    """Per-head budgets onto the device without a blocking copy (which would stall the host
    until every queued kernel has run): pinned staging, non-blocking transfer."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)


def head_index(heads: list[int], device: torch.device) -> slice | torch.Tensor:
    """Index of a list of heads: a slice for a contiguous run (the usual case: every head of a
    kind), else a device tensor copied without a blocking transfer (a Python list index would be
    copied synchronously, stalling the host until the GPU drains its queue)."""
    if heads == list(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0], heads[0] + len(heads))
    return host_values(heads, device)


def last_q_stats(
    q: torch.Tensor, k: torch.Tensor, scale: float, last_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MInference's estimate: softmax attention of the last `last_q` queries over all keys.

    Returns (vertical, slash), each float32 [G, n]: the attention mass each key column receives,
    and the mass on each diagonal offset s = query - key, summed over those queries.
    """
    n = q.shape[0]
    last = min(last_q, n)
    q_last = q[n - last :].float().transpose(0, 1)  # [G, L, d]
    scores = (q_last @ k.float().t()) * scale  # [G, L, n]
    rows = torch.arange(n - last, n, device=q.device)
    keys = torch.arange(n, device=q.device)
    scores.masked_fill_(keys[None, :] > rows[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    vertical = probs.sum(1)
    # Diagonal s of query row r sits at key (n - L + r) - s; gather it, skip negative keys.
    offsets = torch.arange(n, device=q.device)
    key_of = rows[:, None] - offsets[None, :]  # [L, n]
    picked = torch.gather(probs, 2, key_of.clamp(min=0).expand(probs.shape[0], -1, -1))
    slash = (picked * (key_of >= 0)).sum(1)
    return vertical, slash


def top_with_forced(score: torch.Tensor, budget: list[int], forced: list[int]) -> torch.Tensor:
    """Indices [G, K] of each row's top budget[g] entries, the first forced[g] always included.

    Budgets are host integers (from the pattern config), so no device sync is needed. Entries
    beyond a row's budget are -1 ("none" to build_index).
    """
    n = score.shape[1]
    budgets = [min(n, max(b, f)) for b, f in zip(budget, forced)]
    device = score.device
    first = torch.arange(n, device=device)[None, :] < host_values(forced, device)[:, None]
    score = torch.where(first, torch.inf, score)
    k = max(1, max(budgets))
    top = torch.topk(score, k, dim=1, sorted=True).indices
    keep = torch.arange(k, device=device)[None, :] < host_values(budgets, device)[:, None]
    return torch.where(keep, top, -1)


def band_scores(slash: torch.Tensor, block: int) -> torch.Tensor:
    """[G, n]: expected per-row mass that a tile of `block` keys at token shift s captures, from
    diagonal scores [G, n].

    The tile at shift s holds, for the query block starting at q0, the keys q0 - s .. q0 - s +
    block - 1: for a query at row a of its block, the token diagonals s' with s - s' in
    (a - block, a]; over the block's rows, diagonal s' falls in it with weight
    (block - |s' - s|) / block (a triangle centred on s).
    """
    n = slash.shape[1]
    tri = (block - torch.arange(-(block - 1), block, device=slash.device).abs().float()) / block
    pooled = torch.nn.functional.conv1d(slash[:, None], tri.view(1, 1, -1), padding=block - 1)
    return pooled[:, 0, :n]


def block_diagonal_scores(slash: torch.Tensor, block: int) -> torch.Tensor:
    """[G, Q]: expected per-row mass that block diagonal d (key block = query block - d) captures,
    from diagonal scores [G, n]: the band at the aligned shift d * block."""
    return band_scores(slash, block)[:, ::block]


def last_q_scores(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], scale: float, last_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`last_q_stats` of the listed query heads, KV group by KV group: vertical and token-diagonal
    scores, float32 [S, n] each (query [n, H, d], key [n, Hkv, d])."""
    n, group = query.shape[0], query.shape[1] // key.shape[1]
    vertical = torch.zeros(len(heads), n, device=query.device)
    slash = torch.zeros(len(heads), n, device=query.device)
    for kv in range(key.shape[1]):
        rows = [i for i, h in enumerate(heads) if h // group == kv]
        if rows:
            vertical[rows], slash[rows] = last_q_stats(
                query[:, [heads[i] for i in rows]], key[:, kv], scale, last_q
            )
    return vertical, slash


def vertical_slash_scores(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], scale: float, last_q: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and block-diagonal scores of the listed query heads: float32 [S, n] and [S, Q]
    (twin of lastq.last_q_scores_triton)."""
    vertical, slash = last_q_scores(query, key, heads, scale, last_q)
    return vertical, block_diagonal_scores(slash, block)


def top_diagonals(scores: torch.Tensor, budget: list[int], forced: list[int]) -> torch.Tensor:
    """bool [G, Q] cover: the forced[g] nearest block diagonals plus the best, budget[g] in all."""
    nq = scores.shape[1]
    picked = top_with_forced(scores, budget, forced)
    cover = torch.zeros(scores.shape[0], nq + 1, dtype=torch.bool, device=scores.device)
    cover.scatter_(1, torch.where(picked >= 0, picked, nq), True)
    return cover[:, :nq]


def _row_blocks(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """x [n, ...] as views of `block`-row blocks: [n // block, block, ...], then a partial last
    block [1, n % block, ...] where there is one; a reduction over dim 1 reduces each block."""
    n = x.shape[0]
    full = n // block
    parts = [x[: full * block].view(full, block, *x.shape[1:])] if full else []
    if n > full * block:
        parts.append(x[full * block :][None])
    return parts


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The per-block results in order, without a copy where there is one part."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """[n, ..., d] -> [Q, ..., d] float32 mean over each block of `block` rows (last one partial).

    Sums in float32 straight from the input dtype (no float32 copy of x: at 512K tokens and 32
    heads that copy alone would be 8 GiB).
    """
    return _joined([rows.sum(1, dtype=torch.float32) / rows.shape[1] for rows in _row_blocks(x, block)])


def block_ranges(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, ..., d] -> ([Q, ..., d], [Q, ...,  d]): the largest and smallest value of each coordinate
    over each block of `block` rows (last one partial), in x's dtype (elements of x: exact)."""
    parts = _row_blocks(x, block)
    return _joined([rows.amax(1) for rows in parts]), _joined([rows.amin(1) for rows in parts])


def range_rows(q: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ([H, Q, d], [H, Q, d]) of q [n, H, d]: each query block's per-coordinate midpoint
    and half-width of its range; mid . k + radius . |k| is the largest logit any of the block's
    queries gives k."""
    high, low = (x.transpose(0, 1).float() for x in block_ranges(q, block))
    return (high + low) / 2, (high - low) / 2


def block_causal(nq: int, device: torch.device) -> torch.Tensor:
    """bool [Q, Q]: key block j is visible from query block i."""
    i = torch.arange(nq, device=device)
    return i[None, :] <= i[:, None]


def pooled_mean_scores(q: torch.Tensor, k: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    """MInference's block-sparse estimate: block-mean queries x block-mean keys, [G, Q, Q]."""
    qm = block_means(q, block).transpose(0, 1)  # [G, Q, d]
    km = block_means(k, block)  # [Q, d]
    scores = (qm @ km.t()) * scale
    return scores.masked_fill(~block_causal(km.shape[0], q.device), float("-inf"))


def fp8_products(key: torch.Tensor) -> bool:
    """Whether the rescue estimate multiplies in e4m3 (pooled.py): from 16-bit inputs."""
    return key.dtype in (torch.bfloat16, torch.float16)


def pooled_max_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, block: int, skip_keys: torch.Tensor | None = None,
    query_range: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Block-mean query x every key, max-pooled per key block, [G, Q, Q] (torch twin of pooled.py).

    Max- rather than mean-pooling the keys keeps a single salient key (a needle) visible.
    skip_keys (bool [G, n], or [G, Q, n] per query block) removes keys the pattern already holds
    (sinks, verticals), so that they do not win blocks that add nothing. From 16-bit inputs the block means and keys
    are rounded to e4m3 rows first, as the Triton kernel multiplies them (`fp8_products`).

    query_range: instead of the mean, the query block's range bound of each key's logit, the
    largest any of its queries can give it (Quest's bound turned around: per coordinate the
    block's largest query value times the key's positive part plus its smallest times the
    negative part, computed as mid . k + radius . |k| with mid and radius the range's midpoint
    and half-width). A key salient to a few of the block's queries keeps its full logit in the
    bound, where the mean divides it among all the rows. From 16-bit inputs mid and radius are
    e4m3 rows with a scale each (the two products are added, so the scales are applied).
    """
    n = q.shape[0]
    nq = -(-n // block)
    per_key = torch.full((q.shape[1], nq, nq * block), float("-inf"), device=q.device)
    if query_range:
        mid, radius = range_rows(q, block)  # [G, Q, d] each
        if fp8_products(k):
            mid8, mid_scale = quantize_rows(mid.reshape(-1, mid.shape[-1]))
            radius8, radius_scale = quantize_rows(radius.reshape(-1, mid.shape[-1]))
            k8 = quantize_rows(k, tensor_scale(k))[0].float()
            bound = (mid8.float() @ k8.t()) * mid_scale + (radius8.float() @ k8.abs().t()) * radius_scale
            per_key[..., :n] = bound.view(*mid.shape[:2], n) * scale
        else:
            keys = k.float()
            per_key[..., :n] = (mid @ keys.t() + radius @ keys.abs().t()) * scale
        return _pooled(per_key, n, block, skip_keys)
    qm = block_means(q, block).transpose(0, 1)  # [G, Q, d]
    if fp8_products(k):
        # Left unscaled: a row's query scale and the head's key scale are positive factors of
        # the whole row, and the ranking is within a row.
        qm8 = quantize_rows(qm.reshape(-1, qm.shape[-1]))[0]
        k8 = quantize_rows(k, tensor_scale(k))[0]
        product = qm8.float() @ k8.float().t()  # e4m3 products are exact in float32
        per_key[..., :n] = product.view(*qm.shape[:2], n) * scale
    else:
        per_key[..., :n] = (qm @ k.float().t()) * scale
    return _pooled(per_key, n, block, skip_keys)


def _pooled(per_key: torch.Tensor, n: int, block: int, skip_keys: torch.Tensor | None) -> torch.Tensor:
    """[G, Q, Q * block] per-key scores -> [G, Q, Q]: skipped keys out, max-pooled per key block,
    causal blocks only."""
    if skip_keys is not None:
        per_key[..., :n].masked_fill_(
            skip_keys if skip_keys.dim() == 3 else skip_keys[:, None, :], float("-inf")
        )
    heads, nq = per_key.shape[:2]
    scores = per_key.view(heads, nq, nq, block).amax(-1)
    return scores.masked_fill(~block_causal(nq, per_key.device), float("-inf"))


def top_blocks(scores: torch.Tensor, budget: list[int], exclude: torch.Tensor | None = None) -> torch.Tensor:
    """[G, Q, K] key blocks with the best scores per query block (budget[g] of them), -1 padded.

    Excluded and non-causal (-inf) blocks are never picked; rows with fewer candidates pad -1.
    """
    if exclude is not None:
        scores = scores.masked_fill(exclude, float("-inf"))
    nq = scores.shape[-1]
    k = max(1, min(nq, max(budget)))
    top = torch.topk(scores, k, dim=-1)
    limit = host_values(budget, scores.device)[:, None, None]
    keep = (top.values > float("-inf")) & (torch.arange(k, device=scores.device) < limit)
    return torch.where(keep, top.indices, -1)


def force_blocks(scores: torch.Tensor) -> torch.Tensor:
    """Raise the diagonal block and the first block to +inf so every budget keeps them."""
    nq = scores.shape[-1]
    i = torch.arange(nq, device=scores.device)
    forced = (i[None, :] == i[:, None]) | (i[None, :] == 0)
    return scores.masked_fill(forced & block_causal(nq, scores.device), float("inf"))


def held_blocks(cover: torch.Tensor, listed: torch.Tensor | None, rows: slice | None = None) -> torch.Tensor:
    """bool [G, Q, Q]: key blocks a pattern already holds (selected block diagonals, listed blocks);
    with `rows`, those query blocks' only ([G, R, Q])."""
    nq = cover.shape[-1]
    rows = rows or slice(0, nq)
    i = torch.arange(nq, device=cover.device)
    held = cover[:, (i[rows, None] - i[None, :]).clamp(min=0)]
    if listed is not None:
        taken = torch.zeros(*held.shape[:2], nq + 1, dtype=torch.bool, device=cover.device)
        taken.scatter_(2, torch.where(listed[:, rows] >= 0, listed[:, rows].long(), nq), True)
        held |= taken[..., :nq]
    return held


def column_keys(columns: torch.Tensor, n: int) -> torch.Tensor:
    """bool [S, n]: the keys listed in columns [S, C] (entries < 0 or >= n are none)."""
    listed = columns.long()
    keys = torch.zeros(columns.shape[0], n + 1, dtype=torch.bool, device=columns.device)
    keys.scatter_(1, torch.where((listed >= 0) & (listed < n), listed, n), True)
    return keys[:, :n]


def rescue_blocks(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], scale: float, block: int, cover: torch.Tensor,
    listed: torch.Tensor | None, columns: torch.Tensor | None, budget: list[int], query_range: bool = False,
) -> torch.Tensor:  # fmt: skip
    """[S, Q, K] rescue key blocks of the listed query heads (twin of pooled.rescue_blocks_triton).

    Per head: the top budget[s] key blocks by pooled-max score (block-mean query against every key
    but the head's columns; with query_range, the query block's range bound, `pooled_max_scores`),
    among causal blocks that neither a selected block diagonal (cover [S, Q]) nor a listed block
    (listed [S, Q, b], -1 = none) holds; -1 padded, K = max(budget).
    """
    n, group = query.shape[0], query.shape[1] // key.shape[1]
    nq = cover.shape[-1]
    width = max(1, min(nq, max(budget)))
    out = []
    for s, h in enumerate(heads):
        skip = None if columns is None else column_keys(columns[s : s + 1], n)
        scores = pooled_max_scores(query[:, h : h + 1], key[:, h // group], scale, block, skip, query_range)
        held = held_blocks(cover[s : s + 1], None if listed is None else listed[s : s + 1])
        picks = top_blocks(scores, [budget[s]], exclude=held)
        out.append(torch.nn.functional.pad(picks, (0, width - picks.shape[-1]), value=-1))
    return torch.cat(out)


def share_neighbours(picks: torch.Tensor) -> torch.Tensor:
    """[S, Q, K] -> [S, Q, 3K]: each query block also takes the picks of the blocks around it.

    A run of queries seeking one key rarely aligns with block edges, and an edge block's mean
    query is diluted by the others in it.
    """
    before = torch.nn.functional.pad(picks[:, :-1], (0, 0, 1, 0), value=-1)
    after = torch.nn.functional.pad(picks[:, 1:], (0, 0, 0, 1), value=-1)
    return torch.cat([picks, before, after], dim=-1)
