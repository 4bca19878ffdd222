"""The static-cache layout adapters of the optimum-habana fallback, on synthetic tensors.

Property: after any sequence of batch operations (insert, filter, shift left and right, append), each
request's row of the batch holds what the same operations give on that request alone in a one-row
cache, and both equal an oracle: the request's positions right-aligned at the batch's used width,
zeros elsewhere. Rows are read by indexing each layout's documented shapes here, not through the
adapter's own views, so an adapter that views its tensors wrongly fails.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import BloomConfig, GPTBigCodeConfig, LlamaConfig

from tgserve.server.optimum_habana.cache_layouts import (
    Bloom,
    CacheLayout,
    FusedMultiQuery,
    KVDims,
    PerLayerKV,
    layout_for_config,
)
from tgserve.server.optimum_habana.static_cache import StaticCache

KINDS = {"per_layer": PerLayerKV, "fused_mqa": FusedMultiQuery, "bloom": Bloom}


def native_row(kind: str, layer, row: int, dims: KVDims) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `row` as `[kv_heads, max_len, head_dim]`, straight from the layout's shapes."""
    if kind == "per_layer":
        keys, values = layer
        return keys[row], values[row]
    if kind == "fused_mqa":  # [rows, max_len, 2 * head_dim]: keys then values
        return layer[row, None, :, : dims.head_dim], layer[row, None, :, dims.head_dim :]
    keys, values = layer  # bloom: [rows * heads, head_dim, max_len] and [rows * heads, max_len, head_dim]
    heads = slice(row * dims.num_kv_heads, (row + 1) * dims.num_kv_heads)
    return keys[heads].transpose(1, 2), values[heads]


def native_request(kind: str, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """A one-row cache of the layout, built by hand from per-layer `[1, kv_heads, n, head_dim]` keys and values."""
    if kind == "per_layer":
        return [(k.clone(), v.clone()) for k, v in kv]
    if kind == "fused_mqa":
        return [torch.cat([k[:, 0], v[:, 0]], dim=-1) for k, v in kv]
    return [(k[0].transpose(1, 2).contiguous(), v[0].clone()) for k, v in kv]


def random_kv(
    dims: KVDims, rows: int, length: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (rows, dims.num_kv_heads, length, dims.head_dim)
    return [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(dims.num_layers)
    ]


@dataclass
class Tracked:
    """A request in the batch: its positions so far (the oracle) and its one-row cache (the solo run)."""

    history: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [kv_heads, n, head_dim]
    solo: StaticCache


class Scenario:
    """A batch cache and, per request in it, the same operations applied to it alone."""

    def __init__(self, kind: str, dims: KVDims, rows: int, max_len: int, gen: torch.Generator) -> None:
        self.kind, self.dims, self.gen = kind, dims, gen
        self.layout: CacheLayout = KINDS[kind](dims)
        self.batch = StaticCache.allocate(self.layout, rows, max_len)
        self.tracked: list[Tracked] = []  # tracked[i] occupies row i

    def insert(self, length: int) -> None:
        kv = random_kv(self.dims, 1, length, self.gen)
        request = native_request(self.kind, kv)
        assert all(_same(a, b) for a, b in zip(_flat(request), _flat(self.layout.from_kv(kv)), strict=True))
        if length > self.batch.end:
            self.shift_right(length - self.batch.end)
        solo = StaticCache.allocate(self.layout, 1, self.batch.max_len)
        solo.shift_right(self.batch.end)
        solo.insert(0, request, length)
        self.batch.insert(len(self.tracked), request, length)
        self.tracked.append(Tracked([(k[0], v[0]) for k, v in kv], solo))

    def append(self) -> None:
        new_kv = random_kv(self.dims, self.batch.rows, 1, self.gen)
        self.batch.append(new_kv)
        for row, t in enumerate(self.tracked):
            t.solo.append([(k[row : row + 1], v[row : row + 1]) for k, v in new_kv])
            t.history = [
                (torch.cat([hk, k[row]], 1), torch.cat([hv, v[row]], 1))
                for (hk, hv), (k, v) in zip(t.history, new_kv)
            ]

    def filter(self, keep: list[int]) -> None:
        self.batch.filter(keep)
        self.tracked = [self.tracked[row] for row in keep]  # a request alone is unchanged by filter

    def shift_left(self, n: int) -> None:
        self.batch.shift_left(n)
        for t in self.tracked:
            t.solo.shift_left(n)

    def shift_right(self, n: int) -> None:
        self.batch.shift_right(n)
        for t in self.tracked:
            t.solo.shift_right(n)

    def check(self) -> None:
        end, max_len = self.batch.end, self.batch.max_len
        for row, t in enumerate(self.tracked):
            assert t.solo.end == end
            assert torch.equal(self.batch.mask[row], t.solo.mask[0])
            length = t.history[0][0].shape[1]
            expected_mask = torch.zeros(max_len, dtype=torch.long)
            expected_mask[end - length : end] = 1
            assert torch.equal(self.batch.mask[row], expected_mask)
            for layer, solo_layer, (hk, hv) in zip(self.batch.layers, t.solo.layers, t.history):
                batch_kv = native_row(self.kind, layer, row, self.dims)
                solo_kv = native_row(self.kind, solo_layer, 0, self.dims)
                for got, alone, history in zip(batch_kv, solo_kv, (hk, hv)):
                    assert torch.equal(got, alone)
                    expected = torch.zeros_like(got)
                    expected[:, end - length : end] = history
                    assert torch.equal(got, expected)
        for row in range(len(self.tracked), self.batch.rows):  # free rows hold no real position
            assert not self.batch.mask[row].any()


def _flat(layers: list) -> list[torch.Tensor]:
    return [t for layer in layers for t in (layer if isinstance(layer, tuple) else (layer,))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def random_step(s: Scenario, rng: random.Random) -> None:
    """One valid batch operation, chosen at random."""
    b = s.batch
    options = []
    if len(s.tracked) < b.rows:
        options.append("insert")
    if s.tracked and b.end < b.max_len:
        options.append("append")
    if s.tracked:
        options.append("filter")
    if s.tracked and b.leading_padding() > 0:
        options.append("shift_left")
    if b.end < b.max_len:
        options.append("shift_right")
    op = rng.choice(options)
    if op == "insert":
        s.insert(rng.randint(1, b.max_len - 1))
    elif op == "append":
        s.append()
    elif op == "filter":
        s.filter(rng.sample(range(len(s.tracked)), rng.randint(0, len(s.tracked))))  # any subset, any order
    elif op == "shift_left":
        s.shift_left(rng.randint(1, b.leading_padding()))
    else:
        s.shift_right(rng.randint(1, b.max_len - b.end))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("seed", range(6))
def test_batch_operations_match_each_request_alone(kind: str, seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    heads = 1 if kind == "fused_mqa" else rng.randint(1, 3)
    dims = KVDims(num_layers=rng.randint(1, 3), num_kv_heads=heads, head_dim=rng.randint(1, 5))
    s = Scenario(kind, dims, rows=rng.randint(2, 5), max_len=rng.randint(6, 16), gen=gen)
    seen = set()
    for _ in range(60):
        random_step(s, rng)
        s.check()
        seen.add(s.batch.end)
    assert len(seen) > 3  # the used width moved, so the shifts did something


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_scripted_lifecycle_of_a_static_batch(kind: str) -> None:
    """Insert three requests of different lengths, decode, filter the middle one, insert into the
    freed row, and shift left to make room, checking after every operation."""
    dims = KVDims(num_layers=2, num_kv_heads=1 if kind == "fused_mqa" else 2, head_dim=3)
    s = Scenario(kind, dims, rows=3, max_len=8, gen=torch.Generator().manual_seed(0))
    for step in [
        lambda: s.insert(3),
        lambda: s.insert(5),  # longer than the used width: the batch shifts right first
        lambda: s.insert(2),
        s.append,
        lambda: s.filter([0, 2]),
        lambda: s.insert(4),
        s.append,
        s.append,
        lambda: s.shift_left(s.batch.leading_padding()),
        s.append,
    ]:
        step()
        s.check()
    assert s.batch.end == 7 and len(s.tracked) == 3


def test_views_alias_the_storage() -> None:
    dims = KVDims(num_layers=1, num_kv_heads=2, head_dim=3)
    for kind in KINDS:
        layout = KINDS[kind](KVDims(1, 1, 3) if kind == "fused_mqa" else dims)
        layers = layout.allocate(rows=2, max_len=4)
        keys, values = layout.kv_views(layers[0])
        keys[1, :, 2] = 1.0
        values[0, :, 3] = 2.0
        native_keys, native_values = native_row(kind, layers[0], 1, layout.dims)
        assert native_keys[:, 2].eq(1.0).all() and native_keys.sum() == native_keys[:, 2].sum()
        assert native_row(kind, layers[0], 0, layout.dims)[1][:, 3].eq(2.0).all()


def test_shifting_out_real_positions_or_past_max_len_is_refused() -> None:
    cache = StaticCache.allocate(PerLayerKV(KVDims(1, 1, 2)), rows=2, max_len=6)
    cache.shift_right(4)
    cache.insert(0, [(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))], 3)
    assert cache.leading_padding() == 1
    with pytest.raises(ValueError, match="would drop real positions"):
        cache.shift_left(2)
    with pytest.raises(ValueError, match="exceeds max_len"):
        cache.shift_right(3)
    with pytest.raises(ValueError, match="shift_right"):
        cache.insert(1, [(torch.ones(1, 1, 5, 2), torch.ones(1, 1, 5, 2))], 5)


def test_the_fused_layout_has_one_kv_head() -> None:
    with pytest.raises(ValueError, match="one KV head"):
        FusedMultiQuery(KVDims(num_layers=1, num_kv_heads=2, head_dim=4))


def test_layout_for_config_picks_each_family_layout() -> None:
    bigcode = layout_for_config(GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=True))
    assert isinstance(bigcode, FusedMultiQuery)
    assert (bigcode.dims.num_layers, bigcode.dims.num_kv_heads, bigcode.dims.head_dim) == (2, 1, 16)
    bloom = layout_for_config(BloomConfig(hidden_size=64, n_layer=3, n_head=8))
    assert isinstance(bloom, Bloom) and (
        bloom.dims.num_layers,
        bloom.dims.num_kv_heads,
        bloom.dims.head_dim,
    ) == (3, 8, 8)
    llama = layout_for_config(
        LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    )
    assert isinstance(llama, PerLayerKV) and (llama.dims.num_kv_heads, llama.dims.head_dim) == (2, 16)
    with pytest.raises(NotImplementedError, match="multi_query"):
        layout_for_config(GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=False))
