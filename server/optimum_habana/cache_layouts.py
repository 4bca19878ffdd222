"""Static KV-cache layouts of optimum-habana's Gaudi models, one adapter per layout.

The optimum-habana fallback runs Gaudi model classes that own static caches: `rows` sequences by
`max_len` positions, allocated once so that HPU graphs meet fixed shapes. Sequences are left-padded
(right-aligned): every occupied row's newest position is in the same column, and an attention mask
(kept by `StaticCache`) marks the real positions. The layouts differ in where rows and positions sit:

- `PerLayerKV` (Llama and most families): per layer `(k, v)`, each `[rows, kv_heads, max_len, head_dim]`.
- `FusedMultiQuery` (GPT-BigCode, StarCoder): per layer one `[rows, max_len, 2 * head_dim]` tensor,
  keys then values on the last dim, a single KV head.
- `Bloom`: per layer keys `[rows * heads, head_dim, max_len]` (transposed) and values
  `[rows * heads, max_len, head_dim]`.

Each adapter declares only how to allocate its tensors and how to view them with rows first (and
where their position axis is); the batch operations (insert, filter, shift) are written once over
those views, so no batch code indexes one layout's tensors. Plain torch, no Habana imports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

LayerCache = Any  # per layout: a (k, v) tuple or one fused tensor
KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVDims:
    """What a layout needs to allocate a cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"


class CacheLayout(ABC):
    """One static KV layout: allocation, row views, and the batch operations written over them.

    Every operation is in place and needs tensors as `allocate` made them (contiguous), so that the
    views alias their storage. A `request` argument is a one-row cache of this layout whose positions
    are all real, as `from_kv` builds it from a prefill.
    """

    def __init__(self, dims: KVDims) -> None:
        self.dims = dims

    @abstractmethod
    def allocate(self, rows: int, max_len: int) -> list[LayerCache]:
        """Zeroed per-layer tensors for `rows` sequences of `max_len` positions."""

    @abstractmethod
    def row_views(self, layer: LayerCache) -> list[tuple[torch.Tensor, int]]:
        """The layer's tensors viewed with rows on dim 0 (no copy), each with its position dim."""

    @abstractmethod
    def kv_views(self, layer: LayerCache) -> KV:
        """Keys and values as `[rows, kv_heads, positions, head_dim]` views of the layer's storage."""

    def insert(self, layers: list[LayerCache], row: int, request: list[LayerCache], end: int) -> None:
        """Copy `request` into `row` so that its newest position lands in column `end - 1`.

        The rest of the row is zeroed: a free row may hold anything a padded forward wrote there, and a
        NaN behind the mask would still poison attention (NaN times a zero weight is NaN).
        """
        for dst_layer, src_layer in zip(layers, request, strict=True):
            for (dst, dim), (src, _) in zip(
                self.row_views(dst_layer), self.row_views(src_layer), strict=True
            ):
                length = src.shape[dim]
                if length > end:
                    raise ValueError(f"a request of {length} positions does not fit left of column {end}")
                dst[row].zero_()
                dst[row].narrow(dim - 1, end - length, length).copy_(src[0])

    def filter(self, layers: list[LayerCache], keep: Sequence[int]) -> None:
        """Move rows `keep`, in that order, to rows `0 .. len(keep) - 1`; zero the rows after them."""
        for layer in layers:
            for tensor, _ in self.row_views(layer):
                compact_rows(tensor, keep)

    def shift_left(self, layers: list[LayerCache], n: int) -> None:
        """Move every row's positions `n` columns left: the first `n` are dropped, the last `n` zeroed."""
        self._shift(layers, -n)

    def shift_right(self, layers: list[LayerCache], n: int) -> None:
        """Move every row's positions `n` columns right: the last `n` are dropped, the first `n` zeroed."""
        self._shift(layers, n)

    def from_kv(self, kv: Sequence[KV]) -> list[LayerCache]:
        """A cache of this layout holding per-layer keys and values `[rows, kv_heads, length, head_dim]`."""
        rows, _, length, _ = kv[0][0].shape
        layers = self.allocate(rows, length)
        for layer, (keys, values) in zip(layers, kv, strict=True):
            dst_keys, dst_values = self.kv_views(layer)
            dst_keys.copy_(keys)
            dst_values.copy_(values)
        return layers

    def to_kv(self, layers: list[LayerCache], end: int) -> list[KV]:
        """Per-layer keys and values of columns `[0, end)`, as views `[rows, kv_heads, end, head_dim]`."""
        return [tuple(view[:, :, :end] for view in self.kv_views(layer)) for layer in layers]

    def _shift(self, layers: list[LayerCache], offset: int) -> None:
        for layer in layers:
            for tensor, dim in self.row_views(layer):
                shift_along(tensor, dim, offset)

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dims.dtype, device=self.dims.device)


class PerLayerKV(CacheLayout):
    """Per layer `(k, v)`, each `[rows, kv_heads, max_len, head_dim]`: Llama's layout and most others'."""

    def allocate(self, rows: int, max_len: int) -> list[LayerCache]:
        shape = (rows, self.dims.num_kv_heads, max_len, self.dims.head_dim)
        return [(self._zeros(*shape), self._zeros(*shape)) for _ in range(self.dims.num_layers)]

    def row_views(self, layer: LayerCache) -> list[tuple[torch.Tensor, int]]:
        keys, values = layer
        return [(keys, 2), (values, 2)]

    def kv_views(self, layer: LayerCache) -> KV:
        keys, values = layer
        return keys, values


class FusedMultiQuery(CacheLayout):
    """GPT-BigCode's multi-query cache: per layer one `[rows, max_len, 2 * head_dim]`, keys then values."""

    def __init__(self, dims: KVDims) -> None:
        if dims.num_kv_heads != 1:
            raise ValueError(f"the fused multi-query layout has one KV head, not {dims.num_kv_heads}")
        super().__init__(dims)

    def allocate(self, rows: int, max_len: int) -> list[LayerCache]:
        return [self._zeros(rows, max_len, 2 * self.dims.head_dim) for _ in range(self.dims.num_layers)]

    def row_views(self, layer: LayerCache) -> list[tuple[torch.Tensor, int]]:
        return [(layer, 1)]

    def kv_views(self, layer: LayerCache) -> KV:
        fused = layer.unsqueeze(1)  # the single KV head
        return fused[..., : self.dims.head_dim], fused[..., self.dims.head_dim :]


class Bloom(CacheLayout):
    """BLOOM's cache: heads folded into rows, keys transposed for `bmm`.

    Keys `[rows * heads, head_dim, max_len]`, values `[rows * heads, max_len, head_dim]`.
    """

    def allocate(self, rows: int, max_len: int) -> list[LayerCache]:
        heads, head_dim = self.dims.num_kv_heads, self.dims.head_dim
        return [
            (self._zeros(rows * heads, head_dim, max_len), self._zeros(rows * heads, max_len, head_dim))
            for _ in range(self.dims.num_layers)
        ]

    def row_views(self, layer: LayerCache) -> list[tuple[torch.Tensor, int]]:
        keys, values = self._unfolded(layer)
        return [(keys, 3), (values, 2)]

    def kv_views(self, layer: LayerCache) -> KV:
        keys, values = self._unfolded(layer)
        return keys.transpose(2, 3), values

    def _unfolded(self, layer: LayerCache) -> KV:
        """Keys `[rows, heads, head_dim, max_len]` and values `[rows, heads, max_len, head_dim]`, as views."""
        keys, values = layer
        heads, head_dim = self.dims.num_kv_heads, self.dims.head_dim
        return keys.view(-1, heads, head_dim, keys.shape[-1]), values.view(
            -1, heads, values.shape[1], head_dim
        )


def compact_rows(tensor: torch.Tensor, keep: Sequence[int]) -> None:
    """Move rows `keep` of `tensor` (rows on dim 0), in that order, to the front; zero the rest."""
    index = torch.tensor(list(keep), dtype=torch.long, device=tensor.device)
    kept = tensor.index_select(0, index)  # a copy: destination rows overlap source rows
    tensor[: len(keep)].copy_(kept)
    tensor[len(keep) :].zero_()


def shift_along(tensor: torch.Tensor, dim: int, offset: int) -> None:
    """Move `tensor`'s contents `offset` places along `dim` (negative: left), zero-filling the vacated."""
    size, n = tensor.shape[dim], abs(offset)
    if n == 0:
        return
    if n >= size:
        tensor.zero_()
        return
    kept = size - n
    if offset < 0:
        source, target, vacated = (
            tensor.narrow(dim, n, kept),
            tensor.narrow(dim, 0, kept),
            tensor.narrow(dim, kept, n),
        )
    else:
        source, target, vacated = (
            tensor.narrow(dim, 0, kept),
            tensor.narrow(dim, n, kept),
            tensor.narrow(dim, 0, n),
        )
    target.copy_(source.clone())  # the clone: source and target overlap
    vacated.zero_()


def layout_for_config(config: Any, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CacheLayout:
    """The layout that optimum-habana's Gaudi class for `config`'s family keeps its cache in."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if config.model_type == "gpt_bigcode":
        if not config.multi_query:
            # multi-head GPT-BigCode fuses to [rows, heads, max_len, 2 * head_dim]: no adapter yet
            raise NotImplementedError("GPT-BigCode without multi_query has no cache-layout adapter")
        return FusedMultiQuery(KVDims(layers, 1, head_dim, dtype, device))
    if config.model_type == "bloom":
        return Bloom(KVDims(layers, heads, head_dim, dtype, device))
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return PerLayerKV(KVDims(layers, kv_heads, head_dim, dtype, device))
