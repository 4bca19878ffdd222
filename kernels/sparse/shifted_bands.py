"""Accuracy model of token-shift slash bands: diagonals kept as 64-key tiles at any token shift.

The kernel keeps diagonals in block units: key block q - d of query block q, at offsets that are
multiples of the block. A token diagonal s off that grid falls into two block diagonals, so a head
whose diagonals are isolated and off-grid (RoPE echoes, periodic structure) pays two tiles for each,
and at the default budget keeps only about half of them. A band at token shift s instead keeps, for
the query block starting at q0, the keys q0 - s .. q0 - s + 63: the whole of diagonal s for all 64
rows, and its neighbours s' with weight (64 - |s - s'|) / 64, at the cost of one tile.

This module chooses bands from the same last-query diagonal scores as the index (`estimate`) and
turns them into element masks, so `accuracy.score` can say what the kernel would gain from them at
equal tiles before the kernel walks unaligned key ranges. Bands of one head never overlap (their
centres are at least a block apart): a run of bands 64 apart is one contiguous key range, as the
kernel's diagonal runs are now. With the block diagonals' own shifts as bands the model gives the
index's masks exactly (rel L2 equal to the fourth digit on rope and sharp at 32K).

Measured (docs/benchmarks/2026-12-04-sparse-structured-accuracy-cpu.md): greedy bands everywhere
(`choose_bands`) pay where the diagonals are isolated (81 off-grid harmonics at 32K: rel L2 0.137
-> 0.027 at equal tiles) and lose on smooth RoPE bands (rope 0.044 -> 0.057), by their selection:
they catch more of the last queries' diagonal mass but it transfers worse to the other queries.
`choose_mixed` keeps the index's aligned picks and turns only isolated pairs into single bands.
A band holds diagonal s + x for only (64 - |x|) / 64 of a block's rows, so a peak with tails
loses them where the aligned pair held 64 offsets whole: with the pair replaced whenever the band
keeps 90% of its score, the harmonics at 128K (four times wider than at 32K) lost more than they
gained (0.075 -> 0.083); at 97%, 0.137 -> 0.030 at 32K and 0.075 -> 0.067 at 128K, and every
smooth family is within 0.0001 of the index (few or none of their pairs pass). It is the
selection for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgserve.kernels.sparse import estimate
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.index import SparseIndex, build_index, index_to_mask


def choose_bands(scores: torch.Tensor, budget: int, forced: int, block: int) -> torch.Tensor:
    """[G, budget] band shifts: the `forced` aligned ones nearest the diagonal (0, block, ...), then
    the best by score, each suppressing the shifts within a block of it (no two bands overlap).
    -1 where a head runs out of shifts."""
    g, n = scores.shape
    live = scores.clone()
    shifts = torch.arange(n, device=scores.device)
    picks = torch.full((g, budget), -1, dtype=torch.long, device=scores.device)
    for slot in range(budget):
        if slot < forced:
            pick = torch.full((g,), slot * block, device=scores.device)
        else:
            pick = live.argmax(dim=1)
        ok = (pick < n) & (live.gather(1, pick.clamp(max=n - 1)[:, None])[:, 0] > -torch.inf)
        picks[:, slot] = torch.where(ok, pick, -1)
        near = (shifts[None, :] - pick[:, None]).abs() < block
        live.masked_fill_(near & ok[:, None], -torch.inf)
    return picks


def head_bands(query: torch.Tensor, key: torch.Tensor, scale: float, budget: int, forced: int,
               last_q: int = 64, block: int = 64, mixed: bool = False) -> torch.Tensor:  # fmt: skip
    """[H, budget] band shifts of every query head from its last-query diagonal scores: greedy
    (`choose_bands`) or aligned but for isolated peaks (`choose_mixed`)."""
    _, slash = estimate.last_q_scores(query, key, list(range(query.shape[1])), scale, last_q)
    choose = choose_mixed if mixed else choose_bands
    return choose(estimate.band_scores(slash, block), budget, forced, block)


def band_keys(bands: torch.Tensor, query_blocks: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """bool [H, blocks, n]: the keys the bands (shifts [H, B], -1 none) keep for each query block,
    before the causal mask. A band's keys depend only on the query block: q0 - shift and the next
    block - 1; key k is kept when some band starts in (k - block, k], a difference of counts."""
    first = query_blocks[None, :, None] * block - bands[:, None, :]  # [H, blocks, B]
    first = torch.where((bands >= 0)[:, None, :], first, n + block).clamp(min=-block)
    starts = torch.zeros(*first.shape[:2], n + 2 * block + 1, device=bands.device)
    starts.scatter_add_(
        2, (first + block).clamp(max=n + 2 * block), torch.ones_like(first, dtype=torch.float)
    )
    count = starts.cumsum(2)
    return (count[..., block : n + block] - count[..., :n]) > 0


def band_held(bands: torch.Tensor, nq: int, block: int) -> torch.Tensor:
    """bool [H, Q, Q]: every key of key block j is in some band of query block q. A shifted band
    holds part of two blocks; bands never overlap, so a block is whole when its parts add up."""
    heads = bands.shape[0]
    first = torch.arange(nq, device=bands.device)[None, :, None] * block - bands[:, None, :]  # [H, Q, B]
    j = torch.div(first, block, rounding_mode="floor")
    into_first = block - (first - j * block)  # keys of the band in block j; the rest is in j + 1
    keys = torch.zeros(heads, nq, nq + 2, dtype=torch.long, device=bands.device)
    valid = (bands >= 0)[:, None, :]
    for at, count in ((j, into_first), (j + 1, block - into_first)):
        ok = valid & (at >= 0) & (at < nq)
        keys.scatter_add_(2, torch.where(ok, at, nq), torch.where(ok, count, 0))
    return keys[..., :nq] == block


def banded_rescue(query: torch.Tensor, key: torch.Tensor, scale: float, bands: torch.Tensor,
                  columns: torch.Tensor, budget: int, block: int = 64) -> torch.Tensor:  # fmt: skip
    """[H, Q, 3 * budget] rescue blocks as the index chooses them (pooled-max scores without the
    head's columns, shared with the neighbouring query blocks), among blocks no band holds whole."""
    n, group = query.shape[0], query.shape[1] // key.shape[1]
    nq = -(-n // block)
    held = band_held(bands, nq, block)
    blocks = torch.arange(nq, device=query.device)
    picks = []
    for h in range(query.shape[1]):
        # Pooled-max per query block without the head's columns nor the keys its bands already
        # keep (a block half held by a band must win on its other half).
        skip = estimate.column_keys(columns[h : h + 1], n)[:, None, :] | band_keys(
            bands[h : h + 1], blocks, n, block
        )
        scores = estimate.pooled_max_scores(query[:, h : h + 1], key[:, h // group], scale, block, skip)
        picks.append(estimate.top_blocks(scores, [budget], exclude=held[h : h + 1]))
    return estimate.share_neighbours(torch.cat(picks))


@dataclass
class BandedMasks:
    """Mask source: bands [H, B] (token shifts, -1 none) and the rest of a pattern (`rest`: columns
    and listed blocks, no block diagonals), for `accuracy.score`."""

    bands: torch.Tensor
    rest: SparseIndex

    @classmethod
    def from_index(cls, query: torch.Tensor, key: torch.Tensor, scale: float, index: SparseIndex,
                   pattern: HeadPattern, mixed: bool = False) -> BandedMasks:  # fmt: skip
        """The index's columns, its slash budget as bands, rescue blocks chosen around the bands."""
        block = index.block
        bands = head_bands(query, key, scale, -(-pattern.slash // block), -(-pattern.local // block) + 1,
                           block=block, mixed=mixed)  # fmt: skip
        listed = banded_rescue(query, key, scale, bands, index.columns, pattern.rescue, block)
        no_diagonals = torch.zeros_like(index.diag_cover, dtype=torch.bool)
        return cls(bands, build_index(index.seq_len, block, no_diagonals, listed, index.columns))

    def __call__(self, rows: slice) -> torch.Tensor:
        n, b = self.rest.seq_len, self.rest.block
        device = self.bands.device
        q_pos = torch.arange(rows.start, min(rows.stop, n), device=device)
        query_blocks = torch.arange(rows.start // b, (q_pos[-1] // b) + 1, device=device)
        kept = band_keys(self.bands, query_blocks, n, b)[:, q_pos // b - query_blocks[0]]  # [H, r, n]
        causal = torch.arange(n, device=device)[None, None, :] <= q_pos[None, :, None]
        return (kept & causal) | index_to_mask(self.rest, rows)

    def tiles_per_block(self) -> torch.Tensor:
        """int64 [H, Q]: bands that reach a key of the query block, plus the rest's tiles."""
        nq = self.rest.diag_cover.shape[1]
        q0 = torch.arange(nq, device=self.bands.device) * self.rest.block
        bands = self.bands[:, None, :]
        reach = (bands >= 0) & (q0[None, :, None] - bands + self.rest.block > 0)
        return reach.sum(-1) + self.rest.tiles_per_block()


def choose_mixed(scores: torch.Tensor, budget: int, forced: int, block: int, keep: float = 0.97,
                 rounds: int = 8) -> torch.Tensor:  # fmt: skip
    """[G, budget] shifts: block diagonals as the index picks them (aligned top-k), except where an
    isolated pair of them (neighbours unselected) holds one peak, which a single band at its best
    shift keeps `keep` of for one tile instead of two; the tiles freed go to the next best aligned
    diagonals that no band overlaps, for `rounds` rounds. Runs of three or more stay aligned."""
    rows = [_mixed_one(row, budget, forced, block, keep, rounds) for row in scores.cpu()]
    return torch.tensor(rows, dtype=torch.long, device=scores.device)


def _mixed_one(
    score: torch.Tensor, budget: int, forced: int, block: int, keep: float, rounds: int
) -> list[int]:
    n = score.shape[0]
    aligned = score[::block]
    nd = aligned.shape[0]
    order = torch.argsort(aligned, descending=True).tolist()
    chosen = set(range(min(forced, nd)))
    bands: list[int] = []
    blocked: set[int] = set()  # aligned diagonals a band overlaps
    for _ in range(rounds):
        for d in order:  # fill the budget with the best aligned diagonals free of bands
            if len(chosen) + len(bands) >= budget:
                break
            if d not in chosen and d not in blocked:
                chosen.add(d)
        changed = False
        for d in sorted(chosen):
            pair = d + 1 in chosen and d - 1 not in chosen and d + 2 not in chosen and d >= forced
            if not pair:
                continue
            window = score[d * block : min(n, (d + 1) * block + 1)]
            best = int(window.argmax())
            if float(window[best]) >= keep * float(aligned[d] + aligned[d + 1]):
                shift = d * block + best
                chosen -= {d, d + 1}
                bands.append(shift)
                blocked |= {x for x in range(d - 1, d + 3) if abs(x * block - shift) < block}
                changed = True
        if not changed and len(chosen) + len(bands) >= min(budget, nd):
            break
    shifts = sorted([d * block for d in chosen] + bands)[:budget]
    return shifts + [-1] * (budget - len(shifts))
