"""The block/column index the sparse kernel walks, built from per-head pattern parts.

The causal matrix is cut into square blocks of `block` rows/keys. For query block i of head h the
kept keys are the union of three disjoint sources:

1. block diagonals: key blocks i - d for the selected offsets d (A-shape's local window,
   vertical-slash's slashes, dense heads). A token diagonal of offset s = query - key lies in the
   block diagonals floor(s / block) and ceil(s / block); covering both keeps it whole.
2. listed key blocks of that query block (block-sparse, rescue blocks), none on a diagonal of 1.
3. key columns (vertical lines, sinks), sorted; the kernel skips any column already inside a
   block of 1 or 2 so nothing is counted twice.

All of it is O(heads x query blocks x budget) memory, never O(n^2), and built with torch ops on
the device without host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseIndex:
    """Device tensors describing a sparse causal pattern; H = query heads, Q = query blocks."""

    block: int
    seq_len: int
    diag_cover: torch.Tensor  # int8 [H, Q]: 1 where block diagonal d is selected
    blocks: torch.Tensor  # int32 [H, Q, B]: listed key blocks (first block_count valid)
    block_count: torch.Tensor  # int32 [H, Q]
    columns: torch.Tensor  # int32 [H, C]: key columns, ascending, padded with Q * block
    column_count: torch.Tensor  # int32 [H, Q]: columns < (i + 1) * block

    def density(self) -> float:
        """Fraction of the causal block matrix the kernel visits (columns counted as blocks)."""
        q = self.diag_cover.shape[1]
        causal_blocks = q * (q + 1) / 2
        visited = self._diagonal_blocks().sum() + self.block_count.sum()
        visited = visited + (self.column_count.sum() / self.block)
        return float(visited) / (causal_blocks * self.diag_cover.shape[0])

    def tiles(self) -> int:
        """block x block tiles the kernel computes (column chunks of `block` columns count whole)."""
        return int(self.tiles_per_block().sum())

    def tiles_per_block(self) -> torch.Tensor:
        """int64 [H, Q]: the tiles of each query block (diagonal blocks, listed blocks, column chunks)."""
        chunks = (self.column_count.long() + self.block - 1) // self.block
        return self._diagonal_blocks() + self.block_count.long() + chunks

    def _diagonal_blocks(self) -> torch.Tensor:
        """int64 [H, Q]: blocks on the selected diagonals of each query block: query block i
        reaches the offsets d <= i, so it counts the cover's prefix up to i."""
        return self.diag_cover.long().cumsum(dim=1)


def num_blocks(seq_len: int, block: int) -> int:
    """Query (= key) blocks of a sequence."""
    return -(-seq_len // block)


def window_cover(local: torch.Tensor, nblocks: int, block: int) -> torch.Tensor:
    """bool [H, Q]: the block diagonals holding every key less than local[h] tokens back."""
    d = torch.arange(nblocks, device=local.device)[None, :]
    return d <= (local[:, None] + block - 2) // block


def build_index(
    seq_len: int,
    block: int,
    diag_cover: torch.Tensor,  # bool [H, Q]
    blocks: torch.Tensor | None,  # int [H, Q, B], -1 = none
    columns: torch.Tensor | None,  # int [H, C], any order, >= seq_len or < 0 = none
) -> SparseIndex:
    """Normalise the three sources into a SparseIndex (dedup, sort, per-block counts)."""
    heads, nq = diag_cover.shape
    device = diag_cover.device
    qi = torch.arange(nq, device=device)
    # 1. block diagonals: the kernel walks them from the cover itself (diagonal_runs).

    # 2. listed blocks: drop those on a selected diagonal or above the causal diagonal.
    if blocks is None or blocks.shape[-1] == 0:
        blocks = torch.full((heads, nq, 1), -1, dtype=torch.int32, device=device)
    blocks = blocks.long()
    d = (qi[None, :, None] - blocks).clamp(0, nq - 1)
    keep = (
        (blocks >= 0) & (blocks <= qi[None, :, None]) & ~torch.gather(diag_cover, 1, d.flatten(1)).view_as(d)
    )
    blocks = torch.where(keep, blocks, nq).sort(dim=-1).values
    repeated = torch.zeros_like(blocks, dtype=torch.bool)
    repeated[..., 1:] = blocks[..., 1:] == blocks[..., :-1]
    blocks = torch.where(repeated, nq, blocks).sort(dim=-1).values
    block_count = (blocks < nq).sum(-1).to(torch.int32)
    blocks = torch.where(blocks >= nq, -1, blocks).to(torch.int32).contiguous()

    # 3. columns: ascending, padding sorted to the end; counts per query block by searchsorted.
    # Padding sorts last and is never below a query block's end, so no count includes it.
    pad = nq * block
    if columns is None or columns.shape[-1] == 0:
        columns = torch.full((heads, 1), pad, dtype=torch.int32, device=device)
    columns = torch.where((columns >= 0) & (columns < seq_len), columns, pad).sort(dim=1).values
    repeated = torch.zeros_like(columns, dtype=torch.bool)
    repeated[:, 1:] = columns[:, 1:] == columns[:, :-1]
    columns = torch.where(repeated, pad, columns).sort(dim=1).values
    columns = columns.to(torch.int32).contiguous()
    ends = ((qi + 1) * block).to(torch.int32).expand(heads, nq).contiguous()
    column_count = torch.searchsorted(columns, ends).to(torch.int32)
    return SparseIndex(
        block=block,
        seq_len=seq_len,
        diag_cover=diag_cover.to(torch.int8).contiguous(),
        blocks=blocks,
        block_count=block_count.contiguous(),
        columns=columns,
        column_count=column_count.contiguous(),
    )


@dataclass
class DiagonalRuns:
    """An index's block diagonals as runs of consecutive offsets, the walk the kernel takes.

    A run of offsets a..b (a >= 1) reaches, from query block q, the contiguous key blocks
    max(q - b, 0) .. q - a: wholly before the query block, so the kernel walks them without a mask
    and with addresses that advance by one block a step. Offset 0, the diagonal block, is not in a
    run: it is the one block that needs the causal mask.
    """

    first: torch.Tensor  # int32 [H, Q]: each run's first offset a, ascending, padded with Q
    last: torch.Tensor  # int32 [H, Q]: each run's last offset b, padded with Q
    count: torch.Tensor  # int32 [H, Q]: runs that reach a key block from query block q (a <= q)


def diagonal_runs(diag_cover: torch.Tensor) -> DiagonalRuns:
    """The runs of every head's selected block diagonals (cover [H, Q]), without host sync."""
    heads, nq = diag_cover.shape
    d = torch.arange(nq, device=diag_cover.device)
    rest = diag_cover.bool().clone()
    rest[:, 0] = False
    before = torch.nn.functional.pad(rest[:, :-1], (1, 0))  # rest[d - 1]
    after = torch.nn.functional.pad(rest[:, 1:], (0, 1))  # rest[d + 1]

    def ascending(selected: torch.Tensor) -> torch.Tensor:
        return torch.where(selected, d, nq).sort(dim=1).values.to(torch.int32).contiguous()

    first, last = ascending(rest & ~before), ascending(rest & ~after)
    qi = d.to(torch.int32).expand(heads, nq).contiguous()
    count = torch.searchsorted(first, qi, right=True).to(torch.int32).contiguous()
    return DiagonalRuns(first=first, last=last, count=count)


def index_to_mask(index: SparseIndex, rows: slice | None = None) -> torch.Tensor:
    """bool [H, r, n]: the exact element mask the kernel computes for query rows `rows` (all)."""
    n, b = index.seq_len, index.block
    device = index.diag_cover.device
    heads, nq = index.diag_cover.shape
    rows = rows or slice(0, n)
    q_pos = torch.arange(rows.start, min(rows.stop, n), device=device)
    k_pos = torch.arange(n, device=device)
    qb, kb = q_pos[:, None] // b, k_pos[None, :] // b  # [r, 1], [1, n]
    causal = k_pos[None, :] <= q_pos[:, None]
    diag = index.diag_cover.bool()[:, (qb - kb).clamp(min=0)]  # [H, r, n]
    listed = torch.zeros(heads, nq, nq + 1, dtype=torch.bool, device=device)
    slots = torch.arange(index.blocks.shape[-1], device=device)
    valid = slots[None, None, :] < index.block_count[..., None]
    listed.scatter_(2, torch.where(valid, index.blocks.long(), nq), True)
    listed = listed[:, :, :nq][:, qb, kb]  # [H, r, n]
    cols = torch.zeros(heads, n + 1, dtype=torch.bool, device=device)
    cols.scatter_(1, index.columns.long().clamp(max=n), True)  # padding lands in the dropped slot n
    return causal & (diag | listed | cols[:, None, :n])
