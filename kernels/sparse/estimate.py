"""Online estimation of sparse indices, in torch ops on the queries' device (no host sync).

Every function here works on the query heads that share ONE KV head (grouped-query natively: the
group's queries are stacked against their key, which is never repeated), so the caller bounds
memory by looping over KV heads. Shapes: q [n, G, d], k [n, d].
"""

from __future__ import annotations

import torch


def host_values(values: list[int], device: torch.device) -> torch.Tensor:
    """Per-head budgets onto the device without a blocking copy (which would stall the host
    until every queued kernel has run): pinned staging, non-blocking transfer."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)


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


def block_diagonal_scores(slash: torch.Tensor, block: int) -> torch.Tensor:
    """[G, Q]: expected per-row mass that block diagonal d captures, from diagonal scores [G, n].

    Block diagonal d (key block = query block - d) holds, for a query at row a of its block, the
    token diagonals s with d*block - s in (a - block, a]; over the block's rows, diagonal s falls
    in block diagonal d with weight (block - |s - d*block|) / block (a triangle).
    """
    g, n = slash.shape
    nq = -(-n // block)
    padded = torch.zeros(g, 1, (nq + 1) * block, device=slash.device)
    padded[:, 0, :n] = slash
    tri = block - torch.arange(-(block - 1), block, device=slash.device).abs().float()
    pooled = torch.nn.functional.conv1d(padded, (tri / block).view(1, 1, -1), padding=block - 1)
    return pooled[:, 0, 0 : nq * block : block]


def top_diagonals(scores: torch.Tensor, budget: list[int], forced: list[int]) -> torch.Tensor:
    """bool [G, Q] cover: the forced[g] nearest block diagonals plus the best, budget[g] in all."""
    nq = scores.shape[1]
    picked = top_with_forced(scores, budget, forced)
    cover = torch.zeros(scores.shape[0], nq + 1, dtype=torch.bool, device=scores.device)
    cover.scatter_(1, torch.where(picked >= 0, picked, nq), True)
    return cover[:, :nq]


def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """[n, ..., d] -> [Q, ..., d] float32 mean over each block of `block` rows (last one partial)."""
    n = x.shape[0]
    nq = -(-n // block)
    padded = torch.zeros(nq * block, *x.shape[1:], dtype=torch.float32, device=x.device)
    padded[:n] = x.float()
    sums = padded.view(nq, block, *x.shape[1:]).sum(1)
    counts = torch.full((nq,), float(block), device=x.device)
    counts[-1] = n - (nq - 1) * block
    return sums / counts.view(nq, *([1] * (x.dim() - 1)))


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


def pooled_max_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, block: int, skip_keys: torch.Tensor | None = None
) -> torch.Tensor:
    """Block-mean query x every key, max-pooled per key block, [G, Q, Q] (torch twin of pooled.py).

    Max- rather than mean-pooling the keys keeps a single salient key (a needle) visible.
    skip_keys (bool [G, n]) removes keys the pattern already holds as columns (sinks, verticals),
    so that they do not win blocks that add nothing.
    """
    n = q.shape[0]
    nq = -(-n // block)
    qm = block_means(q, block).transpose(0, 1)  # [G, Q, d]
    per_key = torch.full((q.shape[1], nq, nq * block), float("-inf"), device=q.device)
    per_key[..., :n] = (qm @ k.float().t()) * scale
    if skip_keys is not None:
        per_key[..., :n].masked_fill_(skip_keys[:, None, :], float("-inf"))
    scores = per_key.view(q.shape[1], nq, nq, block).amax(-1)
    return scores.masked_fill(~block_causal(nq, q.device), float("-inf"))


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
