"""MInference's vertical-slash index, re-implemented in torch: the side-by-side accuracy baseline.

Faithful to MInference 0.1.6 (`vertical_and_slash_kernel` and its CUDA `convert_vertical_slash_indexes`),
per query head:

1. the last 64 queries' softmax attention over every key; vertical scores are its column sums, slash
   scores its sums along each diagonal offset s = query - key;
2. the top `vertical` columns (the first 30 always) and the top `slash` offsets (the nearest 100
   always), picked token by token;
3. for the query block [start, start + 64), offset s stands for the 64 keys [start - s, start + 64 - s)
   (clamped to start at key 0); offsets are visited from the farthest, and a range that begins within
   64 keys of the current one extends it by 64 keys, else starts a new one. Every range is computed
   in 64-key tiles with the causal mask; verticals outside the ranges are gathered as columns.

The kept set of a query block is therefore causal & (keys in its ranges | vertical columns), and its
cost is the ranges' tiles plus the outside columns in chunks of 64. Nothing here is used to serve:
it scores what tgserve's own estimate keeps against what MInference's would, on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgserve.kernels.sparse.estimate import last_q_scores

BLOCK = 64  # MInference's kernels take 64 x 64 tiles only
FORCED_COLUMNS = 30
FORCED_OFFSETS = 100


@dataclass
class MInferenceIndex:
    """Per query head: verticals [H, V] ascending, offsets [H, S] descending (as the CUDA code
    receives them), and the sequence length."""

    seq_len: int
    verticals: torch.Tensor
    offsets: torch.Tensor

    def query_blocks(self) -> int:
        return -(-self.seq_len // BLOCK)


def minference_index(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float,
    vertical: int = 1000,
    slash: int = 6096,
    last_q: int = 64,
) -> MInferenceIndex:
    """The top verticals and slashes of every query head (query [n, H, d], key [n, Hkv, d])."""
    n, heads, _ = query.shape
    vertical = min(n, max(vertical, FORCED_COLUMNS))
    slash = min(n, max(slash, 50))
    v_scores, s_scores = last_q_scores(query, key, list(range(heads)), scale, last_q)
    v_scores[:, :FORCED_COLUMNS] = torch.inf
    s_scores[:, :FORCED_OFFSETS] = torch.inf
    verticals = torch.topk(v_scores, vertical, dim=1).indices.sort(dim=1).values
    offsets = torch.topk(s_scores, slash, dim=1).indices.sort(dim=1, descending=True).values
    return MInferenceIndex(seq_len=n, verticals=verticals, offsets=offsets)


@dataclass
class Ranges:
    """The key ranges of some query blocks: coverage [H, B, n] bool (if asked for), tiles [H, B] of
    the ranges, and how many verticals [H, B] fall inside them."""

    covered: torch.Tensor | None
    range_tiles: torch.Tensor
    verticals_inside: torch.Tensor


def key_ranges(index: MInferenceIndex, query_blocks: torch.Tensor, with_coverage: bool) -> Ranges:
    """Run the CUDA conversion's range merging for the given query blocks, every head at once.

    The loop is over the offsets (the conversion's order), vectorised over (head, query block).
    """
    n = index.seq_len
    heads = index.offsets.shape[0]
    device = index.offsets.device
    end_m = ((query_blocks + 1) * BLOCK)[None, :].expand(heads, -1)  # [H, B]
    start = torch.zeros_like(end_m)
    end = torch.zeros_like(end_m)
    open_ = torch.zeros_like(end_m, dtype=torch.bool)
    tiles = torch.zeros_like(end_m)
    inside = torch.zeros_like(end_m)
    width = n + 2 * BLOCK + 1 if with_coverage else 1
    diff = torch.zeros(heads, len(query_blocks), width, dtype=torch.int32, device=device)

    def save(which: torch.Tensor) -> None:
        tiles.add_(torch.where(which, (end - start) // BLOCK, 0))
        found = torch.searchsorted(index.verticals, end) - torch.searchsorted(index.verticals, start)
        inside.add_(torch.where(which, found, 0))
        if with_coverage:
            diff.scatter_add_(2, torch.where(which, start, n + 2 * BLOCK)[..., None], which.int()[..., None])
            diff.scatter_add_(2, torch.where(which, end, n + 2 * BLOCK)[..., None], -which.int()[..., None])

    for j in range(index.offsets.shape[1]):
        s = index.offsets[:, j : j + 1]  # [H, 1]
        valid = s < end_m
        e = torch.clamp(end_m - s, min=BLOCK)
        first = valid & ~open_
        jump = valid & open_ & (e > end + BLOCK)
        grow = valid & open_ & ~jump & (e > end)
        save(jump)
        start = torch.where(first | jump, e - BLOCK, start)
        end = torch.where(first | jump, e, torch.where(grow, end + BLOCK, end))
        open_ = open_ | first
    save(open_)
    covered = None
    if with_coverage:
        covered = diff.cumsum(2)[..., :n] > 0
    return Ranges(covered=covered, range_tiles=tiles, verticals_inside=inside)


def kept_mask(index: MInferenceIndex, rows: slice) -> torch.Tensor:
    """bool [H, r, n]: the keys MInference's kernel attends from query rows `rows` (block aligned)."""
    return KeptMasks(index)(rows)


class KeptMasks:
    """`kept_mask` for many row slices: `prepare` runs the range merging once for every query block
    that will be asked for (one pass over the offsets instead of one per slice)."""

    def __init__(self, index: MInferenceIndex) -> None:
        self.index = index
        self.covered: dict[int, torch.Tensor] = {}  # query block -> bool [H, n]
        columns = torch.zeros(
            index.verticals.shape[0], index.seq_len, dtype=torch.bool, device=index.offsets.device
        )
        self.columns = columns.scatter_(1, index.verticals, True)

    def prepare(self, blocks: list[int], chunk: int = 64) -> None:
        todo = sorted(set(blocks) - set(self.covered))
        for i in range(0, len(todo), chunk):
            part = todo[i : i + chunk]
            at = torch.tensor(part, device=self.index.offsets.device)
            covered = key_ranges(self.index, at, with_coverage=True).covered
            self.covered.update({b: covered[:, j] for j, b in enumerate(part)})

    def __call__(self, rows: slice) -> torch.Tensor:
        n = self.index.seq_len
        assert rows.start % BLOCK == 0, "rows start at a query block"
        stop = min(rows.stop, n)
        blocks = list(range(rows.start // BLOCK, -(-stop // BLOCK)))
        self.prepare(blocks)
        covered = torch.stack([self.covered[b] for b in blocks], dim=1)  # [H, B, n]
        q_pos = torch.arange(rows.start, stop, device=covered.device)
        per_row = covered[:, (q_pos - rows.start) // BLOCK]  # [H, r, n]
        causal = torch.arange(n, device=covered.device)[None, :] <= q_pos[:, None]
        return causal & (per_row | self.columns[:, None, :])


def tiles_per_block(index: MInferenceIndex) -> torch.Tensor:
    """int64 [H, Q]: 64 x 64 tiles the kernel computes for each query block: the ranges' tiles, and
    the outside columns (verticals before the block's end and in no range) in chunks of 64."""
    blocks = torch.arange(index.query_blocks(), device=index.offsets.device)
    ranges = key_ranges(index, blocks, with_coverage=False)
    ends = ((blocks + 1) * BLOCK)[None, :].expand(len(index.verticals), -1).contiguous()
    outside = torch.searchsorted(index.verticals, ends) - ranges.verticals_inside
    return ranges.range_tiles + (outside + BLOCK - 1) // BLOCK
