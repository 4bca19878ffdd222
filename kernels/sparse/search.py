"""Per-model pattern search (MInference's offline search): for every head of a layer, the sparse
pattern that keeps the most of its attention on a real prompt, at a given budget.

Candidates at a budget of B keys per query: A-shape (a sink and a local window of B keys), three
vertical-slash splits (B/8, B/2 and 7B/8 of it in columns, the rest in diagonals) and block-sparse
(B / block key blocks); each also takes the default rescue blocks. A candidate is scored by the
attention mass its estimated index (the torch twin's, `attention.estimate_index`, the one serving
uses) keeps on sampled query rows: the last rows of the prompt and runs at a quarter, a half and
three quarters of it, so heads whose far queries look elsewhere are seen. Each head takes its best
candidate. Beside it, the default pattern's split (a seventh of the budget in columns, as 1,000
of 7,096) at the same budget says what the search gains. `config_json` writes the result in
tgserve's `sparse_attention.json` shape, with those scores under "search" (which loading ignores).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.config import DEFAULT_PATTERN, HeadPattern
from tgserve.kernels.sparse.index import index_to_mask

SAMPLED_ROWS = 128  # query rows of each sampled run


@dataclass(frozen=True)
class HeadChoice:
    """A head's best pattern, the mass it keeps, and the mass the default split keeps at the same budget."""

    pattern: HeadPattern
    mass: float
    default_mass: float


def candidate_patterns(budget: int, block: int) -> list[HeadPattern]:
    """The patterns tried for every head, each keeping about `budget` keys a query."""
    sink = min(128, max(1, budget // 8))
    splits = sorted({max(1, budget // 8), budget // 2, budget - budget // 8})
    return [
        HeadPattern("a_shape", sink=sink, local=max(block, budget - sink)),
        *(HeadPattern("vertical_slash", vertical=v, slash=max(block, budget - v)) for v in splits),
        HeadPattern("block_sparse", blocks=max(1, budget // block)),
    ]


def default_split(budget: int, block: int) -> HeadPattern:
    """The default pattern's kind and proportions (1,000 columns to 6,096 diagonals) at `budget`."""
    vertical = max(
        1, round(budget * DEFAULT_PATTERN.vertical / (DEFAULT_PATTERN.vertical + DEFAULT_PATTERN.slash))
    )
    return HeadPattern("vertical_slash", vertical=vertical, slash=max(block, budget - vertical))


def sampled_rows(n: int) -> list[slice]:
    """Runs of query rows scored: the last, and those at a quarter, a half and three quarters."""
    width = min(SAMPLED_ROWS, n)
    starts = {max(0, n * k // 4 - width // 2) for k in (1, 2, 3)} | {n - width}
    return [slice(start, start + width) for start in sorted(starts)]


def kept_mass(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float,
    pattern: HeadPattern | list[HeadPattern],
    block: int,
    last_q: int,
) -> torch.Tensor:
    """float32 [H]: the mean share of each head's attention (over the sampled rows) that the
    pattern's estimated index keeps (one pattern for every head, or a list, one a head).
    query [n, H, d], key [n, Hkv, d]."""
    n, heads, _ = query.shape
    patterns = pattern if isinstance(pattern, list) else [pattern] * heads
    index = estimate_index(query, key, scale, patterns, block, last_q)
    keys = key.float().repeat_interleave(heads // key.shape[1], 1).transpose(0, 1)  # [H, n, d]
    total = torch.zeros(heads)
    rows = sampled_rows(n)
    for part in rows:
        q = query[part].float().transpose(0, 1)  # [H, r, d]
        logits = (q @ keys[:, : part.stop].transpose(1, 2)) * scale
        positions = torch.arange(part.start, part.stop)[:, None]
        logits = logits.masked_fill(torch.arange(part.stop)[None, :] > positions, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        mask = index_to_mask(index, part)[..., : part.stop]
        total += (probs * mask).sum(-1).mean(-1).cpu()
    return total / len(rows)


def search_layer(
    query: torch.Tensor, key: torch.Tensor, scale: float, budget: int, block: int = 64, last_q: int = 64
) -> list[HeadChoice]:
    """Every head's best candidate at `budget` keys a query (`candidate_patterns`)."""
    candidates = candidate_patterns(budget, block)
    masses = torch.stack([kept_mass(query, key, scale, p, block, last_q) for p in candidates])  # [C, H]
    default = kept_mass(query, key, scale, default_split(budget, block), block, last_q)
    best = masses.argmax(0)
    return [
        HeadChoice(candidates[int(c)], float(masses[c, h]), float(default[h]))
        for h, c in enumerate(best.tolist())
    ]


def evaluate_layer(
    query: torch.Tensor, key: torch.Tensor, scale: float, patterns: list[HeadPattern], budget: int, block: int,
    last_q: int,
) -> list[HeadChoice]:  # fmt: skip
    """Given patterns (a searched file's) scored on this prompt, beside the default split at
    `budget`: how they hold on text they were not chosen on."""
    kept = kept_mass(query, key, scale, patterns, block, last_q)
    default = kept_mass(query, key, scale, default_split(budget, block), block, last_q)
    return [HeadChoice(p, float(kept[h]), float(default[h])) for h, p in enumerate(patterns)]


def config_json(
    layers: dict[int, list[HeadChoice]], min_seq_len: int, block: int, last_q: int, about: dict
) -> dict:
    """tgserve's sparse_attention.json: each searched head's pattern (fields that differ from the
    default), and under "search" what was searched (`about`) and every head's scores."""
    default = asdict(DEFAULT_PATTERN)

    def entry(pattern: HeadPattern) -> dict:
        return {k: v for k, v in asdict(pattern).items() if k == "kind" or v != default[k]}

    scores = {
        str(layer): {str(h): [round(c.mass, 4), round(c.default_mass, 4)] for h, c in enumerate(choices)}
        for layer, choices in layers.items()
    }
    return {
        "min_seq_len": min_seq_len,
        "block": block,
        "last_q": last_q,
        "layers": {
            str(layer): {str(h): entry(c.pattern) for h, c in enumerate(choices)}
            for layer, choices in layers.items()
        },
        "search": {
            **about,
            "scores": "per head: [attention mass kept by the chosen pattern, by the default split at this budget]",
            "mass": scores,
        },
    }
