"""Accuracy of a sparse mask against dense fp32 attention, scored on sampled query blocks.

Dense attention of a whole 512K prompt is out of reach on a CPU, and the error is a sum over
rows, so it is estimated on query blocks spread evenly over the prompt (stratified: the same
number in each quarter), and exactly on the rows that look for each needle. Any mask source
works: tgserve's index (`index.index_to_mask`) or the MInference baseline (`minference_baseline`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tgserve.kernels.sparse.synthetic import StructuredPrompt
from tgserve.kernels.sparse.tail import Tail

MaskOfRows = Callable[[slice], torch.Tensor]  # rows -> bool [H, r, n]


@dataclass
class TailedMasks:
    """A mask source whose skipped blocks come back as the tail's virtual keys (`sparse/tail.py`)."""

    mask_of: MaskOfRows
    tail: Tail
    block: int = 64

    def __call__(self, rows: slice) -> torch.Tensor:
        return self.mask_of(rows)


@dataclass
class RowScore:
    """Sums over scored rows and heads, kept so that rows can be pooled in any grouping."""

    err: float = 0.0
    ref: float = 0.0
    mass: float = 0.0
    kept: float = 0.0  # kept (row, key) entries
    causal: float = 0.0  # causal (row, key) entries
    rows: int = 0

    def add(self, other: RowScore) -> RowScore:
        return RowScore(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    @property
    def rel_l2(self) -> float:
        return math.sqrt(self.err / max(self.ref, 1e-30))


@dataclass
class Report:
    rel_l2: float
    quartiles: list[float]  # rel L2 of the rows in each quarter of the prompt
    mass: float  # mean attention mass kept per (row, head)
    density: float  # kept share of the causal entries, on the scored rows
    needles: list[tuple[float, int, float, float]]  # (depth, seekers, recall, rel L2 of the seekers' rows)


def score_rows(
    prompt: StructuredPrompt, mask_of: MaskOfRows, rows: slice, needle=None, seekers: bool | None = None
) -> tuple[RowScore, tuple[float, float]]:
    """Dense vs masked attention on `rows`; with a needle, also the attention its seekers among
    `rows` give it, kept and in all. seekers=False scores only the rows that look for no needle,
    True only those that look for one."""
    end = rows.stop
    probs, causal, lse = dense_probs(prompt, rows, with_lse=True)
    v = prompt.value[:end].float().transpose(0, 1)  # [Hkv, m, d]
    heads, r, d = probs.shape[0], probs.shape[1], v.shape[-1]
    group = heads // v.shape[0]
    mask = mask_of(rows)[..., :end]
    tail = getattr(mask_of, "tail", None)
    # The tail's virtual key of each row's query block, as a share of the row's dense attention.
    blocks = torch.arange(rows.start, end, device=probs.device) // getattr(mask_of, "block", 64)
    tail_share = torch.exp(tail.logit[:, blocks] - lse)[..., None] if tail is not None else None  # [H, r, 1]
    if seekers is not None:
        counted = seeker_rows(prompt, rows).to(probs.device) == seekers
        probs, mask, causal, blocks = probs[:, counted], mask[:, counted], causal[counted], blocks[counted]
        tail_share = tail_share[:, counted] if tail is not None else None
        r = probs.shape[1]
    kept = probs * mask
    dense = (probs.view(v.shape[0], group * r, end) @ v).view(heads, r, d)
    mass = kept.sum(-1, keepdim=True)
    numerator = (kept.view(v.shape[0], group * r, end) @ v).view(heads, r, d)
    if tail is not None:
        numerator = numerator + tail_share * tail.value[:, blocks]
        mass = mass + tail_share
    approx = numerator / mass.clamp(min=1e-30)
    score = RowScore(
        err=(approx - dense).double().pow(2).sum().item(),
        ref=dense.double().pow(2).sum().item(),
        mass=mass.double().sum().item(),
        kept=mask.double().sum().item(),
        causal=float(heads * causal.sum().item()),
        rows=heads * r,
    )
    to_needle = (0.0, 0.0)
    if needle is not None:
        seekers = slice(max(needle.seekers.start, rows.start) - rows.start, needle.seekers.stop - rows.start)
        to_needle = (kept[:, seekers, needle.key].double().sum().item(),
                     probs[:, seekers, needle.key].double().sum().item())  # fmt: skip
    return score, to_needle


def dense_probs(prompt: StructuredPrompt, rows: slice, with_lse: bool = False) -> tuple[torch.Tensor, ...]:
    """Dense causal softmax attention of `rows` over keys [0, rows.stop), float32 [H, r, stop],
    the causal mask [r, stop], and with_lse each row's natural log-sum-exp of scores [H, r]."""
    q = prompt.query[rows].float().transpose(0, 1)  # [H, r, d]
    end = rows.stop
    k = prompt.key[:end].float().transpose(0, 1)  # [Hkv, m, d]
    heads, r, d = q.shape
    group = heads // k.shape[0]
    logits = (q.reshape(k.shape[0], group * r, d) @ k.transpose(1, 2)).view(heads, r, end) * prompt.scale
    device = q.device
    causal = (
        torch.arange(end, device=device)[None, :] <= torch.arange(rows.start, end, device=device)[:, None]
    )
    logits.masked_fill_(~causal, -torch.inf)
    if with_lse:
        return torch.softmax(logits, dim=-1), causal, torch.logsumexp(logits, dim=-1)
    return torch.softmax(logits, dim=-1), causal


def seeker_rows(prompt: StructuredPrompt, rows: slice) -> torch.Tensor:
    """bool [r]: which of `rows` look for some needle."""
    positions = torch.arange(rows.start, rows.stop)
    seeking = torch.zeros(len(positions), dtype=torch.bool)
    for needle in prompt.needles:
        seeking |= (positions >= needle.seekers.start) & (positions < needle.seekers.stop)
    return seeking


def sampled_blocks(n: int, count: int, block: int = 64) -> list[int]:
    """`count` query blocks spread evenly over the prompt (the middle of each of count strata)."""
    nq = -(-n // block)
    return sorted({min(nq - 1, int((i + 0.5) * nq / count)) for i in range(count)})


def score(prompt: StructuredPrompt, mask_of: MaskOfRows, blocks: int = 32, block: int = 64) -> Report:
    """Rel L2 (overall and per quarter), mass and density on sampled blocks; needle recall."""
    n = prompt.query.shape[0]
    seeking = seeker_rows(prompt, slice(0, n)).view(-1, 1)
    seeker_blocks = torch.nonzero(
        torch.nn.functional.pad(seeking, (0, 0, 0, -n % block)).view(-1, block).any(1)
    )
    seeker_blocks = [int(qb) for qb in seeker_blocks]
    if prepare := getattr(mask_of, "prepare", None):  # a mask source that batches its work
        prepare(sampled_blocks(n, blocks, block) + seeker_blocks)
    quarters = [RowScore() for _ in range(4)]
    for qb in sampled_blocks(n, blocks, block):
        rows = slice(qb * block, min(n, (qb + 1) * block))
        part, _ = score_rows(prompt, mask_of, rows, seekers=False)
        quarter = min(3, 4 * rows.start // n)
        quarters[quarter] = quarters[quarter].add(part)
    sampled = RowScore()
    for part in quarters:
        sampled = sampled.add(part)
    needles = []
    for needle in prompt.needles:
        part, kept, seen = RowScore(), 0.0, 0.0
        # A block at a time (masks are asked for from a block's start): 512 seekers' rows at once
        # would hold [H, 576, n] float32 several times over (113 GiB at 512K and 32 heads).
        for start in range(needle.seekers.start // block * block, needle.seekers.stop, block):
            rows = slice(start, min(start + block, needle.seekers.stop))
            chunk, (chunk_kept, chunk_seen) = score_rows(prompt, mask_of, rows, needle)
            part, kept, seen = part.add(chunk), kept + chunk_kept, seen + chunk_seen
        needles.append((needle.depth, len(needle.seekers), kept / max(seen, 1e-30), part.rel_l2))
    seekers = RowScore()
    for qb in seeker_blocks:
        rows = slice(qb * block, min(n, (qb + 1) * block))
        seekers = seekers.add(score_rows(prompt, mask_of, rows, seekers=True)[0])
    # Stratified: the sampled rows stand for every row that seeks no needle; seekers count as they are.
    heads = prompt.query.shape[1]
    weight = (n * heads - seekers.rows) / max(sampled.rows, 1)
    total = seekers.add(RowScore(*(weight * x for x in vars(sampled).values())))
    return Report(
        rel_l2=total.rel_l2,
        quartiles=[p.rel_l2 for p in quarters],
        mass=sampled.mass / max(sampled.rows, 1),
        density=sampled.kept / max(sampled.causal, 1),
        needles=needles,
    )


def oracle(prompt: StructuredPrompt, tiles_per_block: torch.Tensor, block: int = 64) -> MaskOfRows:
    """Mask source that keeps, for each query block, the tiles_per_block[h, q] key blocks holding
    the most true attention mass: the best any block-granular estimate could do at that cost."""

    def mask_of(rows: slice) -> torch.Tensor:
        stop = rows.stop
        device = prompt.query.device
        mask = torch.zeros(prompt.query.shape[1], stop - rows.start, prompt.query.shape[0], dtype=torch.bool,
                           device=device)  # fmt: skip
        for r0 in range(rows.start, stop, block):
            r1 = min(stop, r0 + block)
            probs, causal = dense_probs(prompt, slice(r0, r1))
            key_blocks = -(-r1 // block)
            per_block = torch.nn.functional.pad(probs.sum(1), (0, key_blocks * block - r1))
            per_block = per_block.view(len(probs), key_blocks, block).sum(-1)  # [H, key blocks]
            budget = tiles_per_block[:, r0 // block].clamp(max=key_blocks)
            ranked = per_block.argsort(dim=1, descending=True)
            chosen = torch.zeros_like(per_block, dtype=torch.bool)
            chosen.scatter_(1, ranked, torch.arange(key_blocks, device=device)[None, :] < budget[:, None])
            keys = chosen.repeat_interleave(block, 1)[:, :r1]
            mask[:, r0 - rows.start : r1 - rows.start, :r1] = keys[:, None, :] & causal
        return mask

    return mask_of
