"""The 8-bit KV caches: the KV write, paged decode and paged prefill kernels on an e4m3 (fp8) or
int8 cache with a float32 scale a (token, KV head), each against its torch twin (`reference` with
`kv_scale`)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tgserve.kernels import dispatch, reference
from tgserve.kernels import paged_decode as paged_decode_module
from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import INT8, dequantize_kv, quantize_kv
from tgserve.kernels.kv_write import write_kv
from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.paged_prefill import paged_prefill
from tgserve.kernels.testing import (
    check_eight_bit,
    eight_bit_reference,
    make_paged_batch,
    rel_l2,
    with_8_bit_cache,
)
from tgserve.kernels.triton_common import widen_f16

KV_FORMATS = pytest.mark.parametrize("kv", [FP8, INT8], ids=["e4m3", "int8"])


def _empty_cache(num_blocks: int, block_size: int, heads: int, dim: int, device, kv: torch.dtype) -> tuple:
    cache = torch.full((2, num_blocks, block_size, heads, dim), _poison(kv)).to(kv)
    scale = torch.full((2, num_blocks, heads, block_size), -1.0)  # the pool's layout
    return cache.to(device), scale.to(device)


def test_quantize_kv_rounds_as_torch_and_bounds_the_error():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen) * torch.logspace(-3, 2, 64)[:, None, None]
    q, scale = quantize_kv(x)
    assert q.dtype == FP8 and scale.shape == (64, 4)
    assert torch.equal(q.float().abs().amax(-1), torch.full((64, 4), 448.0))  # each row spans e4m3
    # e4m3 keeps 3 mantissa bits: within half a step, 1/16 of the value, above the subnormals.
    err = (dequantize_kv(q, scale) - x).abs()
    assert (err <= x.abs() / 16 + scale[..., None] * 2.0**-10).all()
    assert rel_l2(dequantize_kv(q, scale), x) < 0.03


def test_quantize_kv_to_int8_rounds_each_row_to_its_127_steps():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen) * torch.logspace(-3, 2, 64)[:, None, None]
    q, scale = quantize_kv(x, INT8)
    assert q.dtype == INT8 and scale.shape == (64, 4)
    assert torch.equal(q.abs().amax(-1), torch.full((64, 4), 127, dtype=INT8))  # each row spans int8
    # Within half a step, the step being the row's largest magnitude / 127.
    assert ((dequantize_kv(q, scale) - x).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()
    assert rel_l2(dequantize_kv(q, scale), x) < 0.01


@triton.jit
def _widen_kernel(x_ptr, out_ptr, N: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(out_ptr + at, widen_f16(tl.load(x_ptr + at)))


@KV_FORMATS
def test_the_kernels_widen_every_8_bit_value_to_f16_exactly(device, kv):
    every = torch.arange(256, dtype=torch.uint8).view(kv)  # every int8; every e4m3 (two NaNs, never stored)
    every = torch.where(every.float().isnan(), 0, every.float()).to(kv)
    widened = torch.empty(256, dtype=torch.float16, device=device)
    _widen_kernel[(1,)](every.to(device), widened, 256)
    assert torch.equal(widened.cpu(), every.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (4, 32, 8), (2, 80, 5)])
@KV_FORMATS
def test_write_kv_into_8_bits_matches_reference(device, dtype, num_kv_heads, head_dim, block_size, kv):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 7, 19
    # Magnitudes over five decades, so rounding carries into the exponent somewhere in every row.
    spread = torch.logspace(-2, 3, head_dim)[torch.randperm(head_dim, generator=gen)]
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * spread).to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * spread).to(dtype)
    value[3] = 0.0  # an all-zero row: a tiny scale, zeros back
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 18]] = -1
    want_cache, want_scale = _empty_cache(num_blocks, block_size, num_kv_heads, head_dim, "cpu", kv)
    reference.write_kv(key, value, want_cache, slots, want_scale)
    cache, scale = _empty_cache(num_blocks, block_size, num_kv_heads, head_dim, device, kv)
    write_kv(key.to(device), value.to(device), cache, slots.to(device), scale)
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0)
    torch.testing.assert_close(cache.cpu().float(), want_cache.float(), rtol=0, atol=0, equal_nan=True)


def _poison(kv: torch.dtype) -> float:
    """What marks a row not yet written: NaN in e4m3, -128 in int8 (the format never writes it)."""
    return -128 if kv == INT8 else float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,splits,window", [((8, 2), 1, None), ((4, 4), 3, None), ((8, 1), 2, 6)])
@KV_FORMATS
def test_decode_over_8_bits_matches_reference(device, dtype, heads, splits, window, kv):
    # Contexts ending past a whole tile by at most half a tile and by more (interpreter tiles of 16
    # keys, GPU tiles of 128): the kernel reads such a rest in a half tile or in a whole one.
    contexts = [1, 7, 8, 17, 45, 100, 200]
    batch = with_8_bit_cache(make_paged_batch([1] * 7, contexts, *heads, 32, 8, dtype, device, seed=3), kv)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3, window, out=out,
                 num_splits=splits, kv_scale=batch.kv_scale)  # fmt: skip
    check_eight_bit(out, eight_bit_reference(batch, 0.3, window), dtype)


@pytest.mark.parametrize("many_programs", [False, True])
@KV_FORMATS
def test_decode_over_8_bits_in_either_gpu_tile(device, monkeypatch, many_programs, kv):
    """The GPU's two fp8 tiles of a decode step (128 keys x 4 warps for few programs, 64 x 2 for a
    program per SM or more), each chosen by pretending the GPU has more or fewer SMs than the launch
    has programs; the step stores its keys, as the engine's decode steps do."""
    if device != "cuda":
        pytest.skip("the tile is chosen by the work only on a GPU (the interpreter takes 16 keys)")
    monkeypatch.setattr(paged_decode_module, "_sm_count", lambda: 1 if many_programs else 10**6)
    want_tile = (
        paged_decode_module.FP8_MANY_PROGRAMS_TILE
        if many_programs
        else paged_decode_module.FP8_FEW_PROGRAMS_TILE
    )
    assert paged_decode_module.fp8_tile(7, 4) == want_tile
    contexts = [1, 63, 64, 97, 130, 200, 300]  # rests under and over half of either tile
    full = make_paged_batch([1] * 7, contexts, 16, 4, 128, 16, torch.float16, device, seed=5)
    batch = with_8_bit_cache(full, kv)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.1, out=out,
                 step_kv=(full.key, full.value, full.slot_mapping), kv_scale=batch.kv_scale)  # fmt: skip
    check_eight_bit(out, eight_bit_reference(batch, 0.1), torch.float16)


@pytest.mark.parametrize("splits", [1, 3])
@KV_FORMATS
def test_decode_stores_the_step_kv_into_8_bits(device, splits, kv):
    """The decode kernel's own store of the step's key and value quantizes as write_kv does: the
    cache and scales end as the twin leaves them, and the output reads the stored row back."""
    full = make_paged_batch([1] * 4, [1, 9, 33, 50], 8, 2, 32, 8, torch.float32, device, seed=21)
    slots = full.slot_mapping.clone()
    slots[1] = -1  # padding: not written
    batch = with_8_bit_cache(full, kv)
    cache, kv_scale = batch.kv_cache.clone(), batch.kv_scale.clone()
    poisoned = slots[slots >= 0].long()
    cache.view(2, -1, *cache.shape[-2:])[:, poisoned] = _poison(kv)
    block_size = cache.shape[2]
    kv_scale[:, poisoned // block_size, :, poisoned % block_size] = float("nan")
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, cache, batch.block_tables, batch.seq_lens, 0.3, out=out, num_splits=splits,
                 step_kv=(full.key, full.value, slots), kv_scale=kv_scale)  # fmt: skip
    want_cache, want_scale = batch.kv_cache.cpu().clone(), batch.kv_scale.cpu().clone()
    # Row 1's slot was not poisoned, so the cache keeps what make_paged_batch stored there.
    check_eight_bit(out, eight_bit_reference(batch, 0.3), torch.float32)
    torch.testing.assert_close(kv_scale.cpu(), want_scale, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cache.cpu().float(), want_cache.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (9, None), (None, 2.0)])
@KV_FORMATS
def test_prefill_over_8_bits_matches_reference(device, dtype, window, softcap, kv):
    # Chunks after a cached prefix, a fresh prompt and a decode row in one step.
    batch = make_paged_batch([5, 12, 1], [21, 12, 40], 8, 2, 32, 8, dtype, device, seed=6)
    batch = with_8_bit_cache(batch, kv)
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.2,
                  window, softcap, out=out, kv_scale=batch.kv_scale)  # fmt: skip
    check_eight_bit(out, eight_bit_reference(batch, 0.2, window, softcap), dtype)


@pytest.mark.parametrize("kv,limit", [(FP8, 0.05), (INT8, 0.02)], ids=["e4m3", "int8"])
def test_8_bit_attention_stays_close_to_full_precision(device, kv, limit):
    """What the format costs: attention over the 8-bit cache against the same cache unquantized."""
    full = make_paged_batch([1] * 3, [64, 100, 200], 8, 2, 64, 16, torch.float32, device, seed=8)
    fp8 = with_8_bit_cache(full, kv)
    exact = reference.paged_attention(full.query.cpu(), full.kv_cache.cpu(), full.block_tables.cpu(),
                                      full.query_start_loc.cpu(), full.seq_lens.cpu(), 0.125)  # fmt: skip
    got = dispatch.paged_decode(fp8.query, fp8.kv_cache, fp8.block_tables, fp8.seq_lens, 0.125,
                                kv_scale=fp8.kv_scale)  # fmt: skip
    assert rel_l2(got.cpu(), exact) < limit


@KV_FORMATS
def test_dispatch_write_then_prefill_on_8_bits(device, kv):
    """dispatch.write_kv then dispatch.paged_prefill, as the backend calls them, on an 8-bit pool."""
    full = make_paged_batch([3, 1, 2], [9, 20, 31], 8, 2, 32, 8, torch.float32, device, seed=22)
    batch = with_8_bit_cache(full, kv)
    cache, kv_scale = batch.kv_cache.clone(), batch.kv_scale.clone()
    cache.view(2, -1, *cache.shape[-2:])[:, full.slot_mapping.long()] = _poison(kv)
    dispatch.write_kv(full.key, full.value, cache, full.slot_mapping, kv_scale)
    got = dispatch.paged_prefill(batch.query, cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                 0.3, kv_scale=kv_scale)  # fmt: skip
    check_eight_bit(got, eight_bit_reference(batch, 0.3), torch.float32)
