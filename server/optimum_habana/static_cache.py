"""A static cache of one layout together with the attention mask of its positions.

Rows are right-aligned: columns `[0, end)` are in use and every occupied row's newest position is in
column `end - 1`; the mask (1 at real positions, 0 at padding) says which row holds what. Every batch
operation moves the KV tensors (through the layout's adapter) and the mask together, by the same
tensor helpers, so the two cannot drift apart. A row is free when its mask is all zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache_layouts import KV, CacheLayout, LayerCache, compact_rows, shift_along


@dataclass
class StaticCache:
    """`rows` x `max_len` positions of one layout, the mask of the real ones, and the used width."""

    layout: CacheLayout
    layers: list[LayerCache]
    mask: torch.Tensor  # [rows, max_len], int64: 1 at real positions
    end: int = 0

    @classmethod
    def allocate(cls, layout: CacheLayout, rows: int, max_len: int) -> StaticCache:
        """An empty cache: every row free, no column in use."""
        mask = torch.zeros(rows, max_len, dtype=torch.long, device=layout.dims.device)
        return cls(layout, layout.allocate(rows, max_len), mask)

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]

    def occupied(self) -> torch.Tensor:
        """`[rows]` bool: which rows hold a sequence."""
        return self.mask[:, : self.end].any(dim=1)

    def leading_padding(self) -> int:
        """How many columns at the left no row uses: how far `shift_left` may go."""
        used = self.mask[:, : self.end].any(dim=0).nonzero()
        return int(used[0]) if len(used) else self.end

    def insert(self, row: int, request: list[LayerCache], length: int) -> None:
        """Put a one-row cache of `length` real positions into `row`, its newest position at `end - 1`."""
        if length > self.end:
            raise ValueError(f"a request of {length} positions needs shift_right({length - self.end}) first")
        self.layout.insert(self.layers, row, request, self.end)
        self.mask[row].zero_()
        self.mask[row, self.end - length : self.end] = 1

    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows `keep`, compacted in that order to the first rows; the others become free."""
        self.layout.filter(self.layers, keep)
        compact_rows(self.mask, keep)

    def shift_left(self, n: int) -> None:
        """Drop `n` leading columns of padding, freeing `n` columns at the right."""
        if n > self.leading_padding():
            raise ValueError(
                f"shift_left({n}) would drop real positions: only {self.leading_padding()} are padding"
            )
        self.layout.shift_left(self.layers, n)
        shift_along(self.mask, 1, -n)
        self.end -= n

    def shift_right(self, n: int) -> None:
        """Add `n` columns of padding at the left of every row, e.g. to insert a longer request."""
        if self.end + n > self.max_len:
            raise ValueError(f"shift_right({n}) past column {self.end} exceeds max_len {self.max_len}")
        self.layout.shift_right(self.layers, n)
        shift_along(self.mask, 1, n)
        self.end += n

    def append(self, new_kv: Sequence[KV]) -> None:
        """Write one step's keys and values `[rows, kv_heads, 1, head_dim]` into column `end`.

        Every row is written, as a static-shape forward computes every row; only occupied rows mark the
        new position real, so free rows stay free.
        """
        if self.end >= self.max_len:
            raise ValueError(f"no column left of max_len {self.max_len}: shift_left first")
        occupied = self.occupied()
        for layer, (keys, values) in zip(self.layers, new_kv, strict=True):
            dst_keys, dst_values = self.layout.kv_views(layer)
            dst_keys[:, :, self.end : self.end + 1].copy_(keys)
            dst_values[:, :, self.end : self.end + 1].copy_(values)
        self.mask[:, self.end] = occupied.long()
        self.end += 1
