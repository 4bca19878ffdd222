"""Paged decode and paged/varlen prefill kernels against their torch twins (small sizes)."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import reference
from tgserve.kernels.decode_launch import split_counters
from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.paged_prefill import paged_prefill, varlen_prefill
from tgserve.kernels.testing import make_paged_batch, max_abs_err, to_device

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3}
# (num_heads, num_kv_heads): MHA, GQA 4, GQA 8, MQA.
HEADS = [(2, 2), (8, 2), (16, 2), (8, 1)]


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "rows left unwritten (poisoned output survived)"
    assert max_abs_err(got.cpu(), want) <= ATOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
def test_decode_matches_reference(device, dtype, heads):
    # Ragged contexts crossing page and tile boundaries: 1, page-1, page, tile+1, several tiles.
    seq_lens = [1, 7, 8, 17, 45]
    batch = make_paged_batch([1] * 5, seq_lens, *heads, 32, 8, dtype, device, seed=3)
    want = reference.paged_attention(
        batch.query.cpu(),
        batch.kv_cache.cpu(),
        batch.block_tables.cpu(),
        batch.query_start_loc.cpu(),
        batch.seq_lens.cpu(),
        0.3,
    )
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3, out=out)
    _check(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "window,softcap,splits", [(None, None, 3), (5, None, 1), (20, 2.0, 4), (None, 1.5, 1), (None, None, 16)]
)
def test_decode_window_softcap_splits(device, dtype, window, softcap, splits):
    seq_lens = [3, 16, 33, 50]
    batch = make_paged_batch([1] * 4, seq_lens, 8, 2, 64, 16, dtype, device, seed=4)
    want = reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), batch.block_tables.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), 0.125,
                                     window, softcap)  # fmt: skip
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.125, window, softcap,
                 out=out, num_splits=splits)  # fmt: skip
    _check(out, want, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_head_dims(device, head_dim):
    batch = make_paged_batch([1, 1], [9, 24], 4, 1, head_dim, 16, torch.float16, device, seed=5)
    want = reference.paged_attention(
        batch.query.cpu(),
        batch.kv_cache.cpu(),
        batch.block_tables.cpu(),
        batch.query_start_loc.cpu(),
        batch.seq_lens.cpu(),
        head_dim**-0.5,
    )
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5, out=out,
                 num_splits=2)  # fmt: skip
    _check(out, want, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_matches_reference(device, dtype, heads):
    # A fresh prompt, a chunk after a prefix hit, a decode row and an empty sequence, one launch.
    q_lens, seq_lens = [13, 6, 1, 0, 20], [13, 30, 9, 4, 21]
    batch = make_paged_batch(q_lens, seq_lens, *heads, 32, 8, dtype, device, seed=6)
    want = reference.paged_attention(
        batch.query.cpu(),
        batch.kv_cache.cpu(),
        batch.block_tables.cpu(),
        batch.query_start_loc.cpu(),
        batch.seq_lens.cpu(),
        0.2,
    )
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                  0.2, out=out)  # fmt: skip
    _check(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,softcap", [(4, None), (None, 3.0), (11, 1.0)])
def test_prefill_window_softcap(device, dtype, window, softcap):
    q_lens, seq_lens = [17, 5, 1], [17, 40, 26]
    batch = make_paged_batch(q_lens, seq_lens, 4, 2, 64, 16, dtype, device, seed=7)
    want = reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), batch.block_tables.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), 0.125,
                                     window, softcap)  # fmt: skip
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                  0.125, window, softcap, out=out)  # fmt: skip
    _check(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,window", [((4, 4), None), ((8, 1), None), ((8, 2), 6)])
def test_varlen_dense_prefill(device, dtype, heads, window):
    gen = torch.Generator().manual_seed(8)
    lens = [1, 16, 23]
    total = sum(lens)
    q = torch.randn(total, heads[0], 32, generator=gen).to(dtype)
    k = torch.randn(total, heads[1], 32, generator=gen).to(dtype)
    v = torch.randn(total, heads[1], 32, generator=gen).to(dtype)
    cu = torch.tensor([0, 1, 17, 40], dtype=torch.int32)
    want = reference.varlen_attention(q, k, v, cu, 0.2, window)
    out = torch.full_like(q, float("nan")).to(device)
    varlen_prefill(q.to(device), k.to(device), v.to(device), cu.to(device), 0.2, window, out=out)
    _check(out, want, dtype)


def test_varlen_prefill_takes_keys_and_values_of_different_layouts(device):
    """Models hand over views of one fused QKV projection: values keep that row stride, keys
    (rotated) are fresh tensors. The kernel reads both with one set of strides, so it must not
    be given them as they are."""
    gen = torch.Generator().manual_seed(4)
    total, heads, kv_heads, dim = 40, 8, 2, 32
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(total, heads, dim).contiguous(), k.reshape(total, kv_heads, dim).contiguous()
    v = v.view(total, kv_heads, dim)
    cu = torch.tensor([0, 25, 40], dtype=torch.int32)
    want = reference.varlen_attention(q, k, v, cu, 0.2, 16)
    got = varlen_prefill(q.to(device), k.to(device), to_device(v, device), cu.to(device), 0.2, 16)
    _check(got, want, torch.float32)


def test_decode_with_an_underestimated_max_seq_len(device):
    """max_seq_len only sizes the splits; the last split still covers the whole context."""
    batch = make_paged_batch([1, 1], [70, 9], 4, 1, 32, 8, torch.float32, device, seed=9)
    want = reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), batch.block_tables.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), 0.3)  # fmt: skip
    got = paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3, max_seq_len=20,
                       num_splits=2)  # fmt: skip
    _check(got, want, torch.float32)


def _reference(batch, scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    return reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), batch.block_tables.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), scale, window,
                                     softcap)  # fmt: skip


def _split_decode(batch, scale: float, splits: int, window: int | None = None, softcap: float | None = None):
    """The split path forced (the interpreter's choose_splits picks 1), into a NaN-poisoned output:
    a group whose last split never merged leaves NaN behind."""
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, scale, window, softcap,
                 out=out, num_splits=splits)  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("splits", [2, 5, 8])
def test_decode_last_split_merges(device, dtype, heads, splits):
    """The split that arrives last merges the group. Under the interpreter's 16-token tiles the 1-
    and 9-token contexts fill split 0 alone and 40 fills three: the empty splits must still count."""
    batch = make_paged_batch([1] * 4, [1, 9, 40, 70], *heads, 32, 8, dtype, device, seed=11)
    _check(_split_decode(batch, 0.3, splits), _reference(batch, 0.3), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (16, 2), (8, 1)])
@pytest.mark.parametrize("window,softcap", [(5, None), (24, 2.0)])
def test_decode_splits_with_sliding_window(device, dtype, heads, window, softcap):
    """Splits wholly before the window do no work but still store an empty partial and count in."""
    batch = make_paged_batch([1] * 3, [3, 30, 64], *heads, 32, 16, dtype, device, seed=12)
    got = _split_decode(batch, 0.2, 4, window, softcap)
    _check(got, _reference(batch, 0.2, window, softcap), dtype)


@pytest.mark.parametrize(
    "heads,head_dim,splits", [((16, 2), 128, 32), ((6, 2), 256, 32), ((32, 1), 128, 32), ((6, 2), 32, 3)]
)
def test_decode_split_merge_in_steps(device, heads, head_dim, splits):
    """The merge loads a few heads and splits at a time and carries its max, sum and output between
    loads. At 32 splits the 300-token context fills 19 (16-token tiles): a group of 8 heads of 128
    dims takes 8 splits a load (three loads), 3 heads of 256 take 8 (a padded fourth row), a group
    of 32 takes two row steps of 16 heads at 4 splits a load; the 20-token context fills 2."""
    batch = make_paged_batch([1, 1], [20, 300], *heads, head_dim, 16, torch.float32, device, seed=13)
    _check(_split_decode(batch, head_dim**-0.5, splits), _reference(batch, head_dim**-0.5), torch.float32)


def _check_same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, the spare blocks' NaN poison included."""
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0, equal_nan=True)


def _without_step_kv(batch, slots: torch.Tensor) -> torch.Tensor:
    """The batch's cache with the step's slots (those >= 0) poisoned with NaN: a read before the
    write shows in the output."""
    cache = batch.kv_cache.clone()
    cache.view(2, -1, *cache.shape[-2:])[:, slots[slots >= 0].long()] = float("nan")
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_stores_the_step_kv_before_reading_it(device, dtype, splits, window):
    """The decode kernel stores the step's key and value itself: the output is attention over the
    full context and the cache ends as write_kv leaves it. Sequence 1 is padding (slot -1): its
    cache row is neither written nor needed."""
    batch = make_paged_batch([1] * 4, [1, 9, 33, 50], 8, 2, 32, 8, dtype, device, seed=21)
    slots = batch.slot_mapping.clone()
    slots[1] = -1
    cache = _without_step_kv(batch, slots)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, cache, batch.block_tables, batch.seq_lens, 0.3, window, out=out, num_splits=splits,
                 step_kv=(batch.key, batch.value, slots))  # fmt: skip
    _check(out, _reference(batch, 0.3, window), dtype)
    _check_same_cache(cache, batch.kv_cache)


def test_dispatch_decode_stores_the_step_kv(device):
    """dispatch.paged_decode with step_kv: the CUDA kernel stores it itself, the CPU twin writes it
    first; either way the result is attention over the full cache."""
    from tgserve.kernels import dispatch

    batch = make_paged_batch([1, 1, 1], [9, 20, 31], 8, 2, 32, 8, torch.float32, device, seed=22)
    cache = _without_step_kv(batch, batch.slot_mapping)
    got = dispatch.paged_decode(batch.query, cache, batch.block_tables, batch.seq_lens, 0.3,
                                step_kv=(batch.key, batch.value, batch.slot_mapping))  # fmt: skip
    _check(got, _reference(batch, 0.3), torch.float32)
    _check_same_cache(cache, batch.kv_cache)


def test_dispatch_prefill_reads_the_stored_step_kv(device):
    """dispatch.paged_prefill after dispatch.write_kv (as the backend calls them): attention over
    the full cache, decode rows among prompt rows."""
    from tgserve.kernels import dispatch

    batch = make_paged_batch([3, 1, 2], [9, 20, 31], 8, 2, 32, 8, torch.float32, device, seed=22)
    cache = _without_step_kv(batch, batch.slot_mapping)
    dispatch.write_kv(batch.key, batch.value, cache, batch.slot_mapping)
    got = dispatch.paged_prefill(batch.query, cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                 0.3)  # fmt: skip
    _check(got, _reference(batch, 0.3), torch.float32)
    _check_same_cache(cache, batch.kv_cache)


def test_merge_tile_fits_the_register_budget():
    from tgserve.kernels.decode_launch import MAX_AUTO_SPLITS, merge_tile

    assert merge_tile(4, 128) == (4, 16)  # Llama-3-8B: all 4 heads, 16 splits a load
    assert merge_tile(8, 128) == (8, 8)
    assert merge_tile(3, 256) == (4, 8)
    assert merge_tile(32, 128) == (16, 4)
    assert merge_tile(48, 256) == (8, 4)
    assert merge_tile(1, 64) == (1, MAX_AUTO_SPLITS)
    for group, dims in [(4, 128), (48, 256), (1, 64), (1, 16)]:
        rows, chunk = merge_tile(group, dims)
        assert rows * chunk * dims <= 8192 and chunk <= MAX_AUTO_SPLITS


def test_split_counters_are_zero_after_each_launch(device):
    """The last split resets its counter, so the next launch, with the same or another split
    count and batch, counts from zero as a CUDA-graph replay does (no memset in between)."""
    first = make_paged_batch([1] * 3, [5, 33, 60], 8, 2, 32, 8, torch.float32, device, seed=14)
    second = make_paged_batch([1] * 2, [48, 2], 8, 2, 32, 8, torch.float32, device, seed=15)
    for batch, splits in [(first, 4), (first, 4), (second, 3), (first, 7), (first, 4)]:
        _check(_split_decode(batch, 0.3, splits), _reference(batch, 0.3), torch.float32)
        assert not split_counters(torch.device(device), 1).any()


def test_split_counters_grow_with_the_launch():
    """At least 8192 slots from the start; a launch needing more gets a larger zeroed buffer."""
    cpu = torch.device("cpu")
    first = split_counters(cpu, 1)
    assert first.numel() >= 8192 and first.dtype == torch.int32 and not first.any()
    grown = split_counters(cpu, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any()
    assert split_counters(cpu, 1) is grown


@pytest.mark.parametrize("head_dim", [128, 256])
def test_prefill_head_dims(device, head_dim):
    batch = make_paged_batch([5, 1], [21, 9], 4, 1, head_dim, 16, torch.float16, device, seed=10)
    want = reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), batch.block_tables.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), head_dim**-0.5)  # fmt: skip
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                  head_dim**-0.5, out=out)  # fmt: skip
    _check(out, want, torch.float16)
