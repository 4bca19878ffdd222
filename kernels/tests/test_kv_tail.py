"""An 8-bit cache's full-precision tail (`server/kv_cache/tail_blocks.py`) in the kernels: the KV
write, paged decode (with its own store, splits, a window, selection) and paged prefill read a
sequence's current block from its tail slot where it has one, each against the torch twins
(`reference.write_tail`, `reference.current_block_from_tail`)."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import dispatch, reference
from tgserve.kernels.decode_selection import DecodeSelection
from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import INT8
from tgserve.kernels.kv_write import write_kv
from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.paged_prefill import paged_prefill
from tgserve.kernels.testing import (
    EIGHT_BIT_ATOL,
    check_eight_bit,
    eight_bit_reference,
    make_paged_batch,
    max_abs_err,
    with_8_bit_cache,
)

KV_FORMATS = pytest.mark.parametrize("kv", [FP8, INT8], ids=["e4m3", "int8"])


def _tails(full, with_slot: list[bool], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(tail cache, slot_of) giving each sequence marked in `with_slot` a slot for its current
    block, holding that block's rows of the unquantized cache; every other row NaN, so a read past
    the context, or of a slot's row never written, shows."""
    cache = full.kv_cache.cpu()
    block_size = cache.shape[2]
    slots = len(with_slot) + 1
    tail = torch.full((2, slots, *cache.shape[2:]), float("nan"), dtype=dtype)
    slot_of = torch.full((cache.shape[1],), -1, dtype=torch.int32)
    for seq, (n, has) in enumerate(zip(full.seq_lens.tolist(), with_slot, strict=True)):
        if not has:
            continue
        column = (n - 1) // block_size
        block = int(full.block_tables[seq, column])
        slot = slots - 1 - seq  # not the sequence's own index: the map is what the kernels follow
        slot_of[block] = slot
        rows = n - column * block_size
        tail[:, slot, :rows] = cache[:, block, :rows].to(dtype)
    return tail, slot_of


def _on(device, tail: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return tail[0].to(device), tail[1].to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,splits,window", [((8, 2), 1, None), ((4, 4), 3, None), ((8, 1), 2, 6)])
@KV_FORMATS
def test_decode_reads_the_current_block_from_its_tail_slot(device, dtype, heads, splits, window, kv):
    contexts = [1, 7, 8, 17, 45, 100, 200]
    full = make_paged_batch([1] * 7, contexts, *heads, 32, 8, dtype, device, seed=3)
    batch = with_8_bit_cache(full, kv)
    tail = _tails(full, [True, True, False, True, True, False, True], dtype)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3, window, out=out,
                 num_splits=splits, kv_scale=batch.kv_scale, tail=_on(device, tail))  # fmt: skip
    want = eight_bit_reference(batch, 0.3, window, tail=tail)
    check_eight_bit(out, want, dtype)
    # The twin's tail is what changes the result: without it, the current blocks' rows are 8-bit.
    without = eight_bit_reference(batch, 0.3, window)
    differs = (want - without).abs().amax((1, 2)) > 0
    assert differs.tolist() == [True, True, False, True, True, False, True]


@KV_FORMATS
def test_a_context_within_its_slotted_block_reads_no_8_bit_row(device, kv):
    """Every key of these contexts lies in the current block: with a slot, attention is the
    unquantized cache's."""
    full = make_paged_batch([1] * 3, [1, 5, 8], 8, 2, 32, 8, torch.float32, device, seed=9)
    batch = with_8_bit_cache(full, kv)
    out = paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3,
                       kv_scale=batch.kv_scale, tail=_on(device, _tails(full, [True] * 3, torch.float32)))  # fmt: skip
    exact = reference.paged_attention(full.query.cpu(), full.kv_cache.cpu(), full.block_tables.cpu(),
                                      full.query_start_loc.cpu(), full.seq_lens.cpu(), 0.3)  # fmt: skip
    assert max_abs_err(out.cpu(), exact) <= EIGHT_BIT_ATOL[torch.float32]


@pytest.mark.parametrize("splits", [1, 3])
@KV_FORMATS
def test_decode_stores_the_step_kv_into_the_tail_slot_too(device, splits, kv):
    """The decode kernel's own store: the step's rows in blocks with a slot land there unquantized
    (and in the pool as always), and the output reads them back from the slot."""
    dtype = torch.float32
    full = make_paged_batch([1] * 4, [1, 9, 33, 50], 8, 2, 32, 8, dtype, device, seed=21)
    batch = with_8_bit_cache(full, kv)
    with_slot = [True, False, True, True]
    tail_cache, slot_of = _tails(full, with_slot, dtype)
    block_size = tail_cache.shape[2]
    want_tail = tail_cache.clone()
    slots = full.slot_mapping.cpu()
    for seq, has in enumerate(with_slot):  # the step's row not yet in its slot: the kernel stores it
        if has:
            block, offset = int(slots[seq]) // block_size, int(slots[seq]) % block_size
            tail_cache[:, int(slot_of[block]), offset] = float("nan")
    tail = _on(device, (tail_cache, slot_of))
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3, out=out, num_splits=splits,
                 step_kv=(full.key, full.value, full.slot_mapping), kv_scale=batch.kv_scale, tail=tail)  # fmt: skip
    torch.testing.assert_close(tail[0].cpu(), want_tail, rtol=0, atol=0, equal_nan=True)
    check_eight_bit(out, eight_bit_reference(batch, 0.3, tail=(want_tail, slot_of)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@KV_FORMATS
def test_write_kv_stores_rows_of_slotted_blocks_in_the_tail(device, dtype, kv):
    full = make_paged_batch([5, 12, 1], [21, 12, 40], 8, 2, 32, 8, dtype, device, seed=6)
    batch = with_8_bit_cache(full, kv)
    tail_cache, slot_of = _tails(full, [True, False, True], dtype)
    tail_cache.fill_(float("nan"))
    cache, scale = batch.kv_cache.clone(), batch.kv_scale.clone()
    tail = _on(device, (tail_cache, slot_of))
    write_kv(full.key, full.value, cache, full.slot_mapping, scale, tail)
    want_tail = tail_cache.clone()
    reference.write_tail(full.key.cpu(), full.value.cpu(), full.slot_mapping.cpu(), (want_tail, slot_of))
    torch.testing.assert_close(tail[0].cpu(), want_tail, rtol=0, atol=0, equal_nan=True)
    written = int((~want_tail.isnan()).any(-1).any(-1).sum())
    assert written == 2 * (5 % 8 + 1)  # both sides: seq 0's rows of its current block (16-20), seq 2's row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 9])
@KV_FORMATS
def test_prefill_reads_the_current_block_from_its_tail_slot(device, dtype, window, kv):
    # Chunks after a cached prefix, a fresh prompt and a decode row in one step.
    full = make_paged_batch([5, 12, 1], [21, 12, 40], 8, 2, 32, 8, dtype, device, seed=6)
    batch = with_8_bit_cache(full, kv)
    tail = _tails(full, [True, True, True], dtype)
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.2,
                  window, out=out, kv_scale=batch.kv_scale, tail=_on(device, tail))  # fmt: skip
    check_eight_bit(out, eight_bit_reference(batch, 0.2, window, tail=tail), dtype)


def test_selected_decode_reads_the_current_block_from_its_tail_slot(device):
    """Selective decode reads the chosen blocks, then the current one last: from its slot."""
    block_size = 16
    full = make_paged_batch([1, 1, 1], [700, 330, 1001], 8, 2, 32, block_size, torch.float32, seed=3)
    summary = torch.zeros(2, full.kv_cache.shape[1], 2, 32)
    for seq, n in enumerate(full.seq_lens.tolist()):
        keys, _ = reference.gather_kv(full.kv_cache, full.block_tables[seq], n)
        slots = (
            full.block_tables[seq, torch.arange(n) // block_size].long() * block_size
            + torch.arange(n) % block_size
        )
        reference.update_key_summaries(keys, slots, summary, block_size)
    batch = with_8_bit_cache(full, FP8)
    selection = DecodeSelection(128, 200, 16, 16)
    tables, seq_lens = batch.block_tables, batch.seq_lens
    chosen = dispatch.select_decode_blocks(batch.query, summary, tables, seq_lens, selection, batch.kv_cache,
                                           batch.kv_scale)  # fmt: skip
    lengths = selection.lengths(seq_lens, block_size, tables.shape[1])
    assert (lengths > 0).all()
    tail = _tails(full, [True, True, True], torch.float32)
    want = reference.selected_decode(batch.query, batch.kv_cache, tables, seq_lens, chosen, lengths, 0.2,
                                     kv_scale=batch.kv_scale, tail=tail)  # fmt: skip
    got = paged_decode(batch.query.to(device), batch.kv_cache.to(device), tables.to(device), seq_lens.to(device),
                       0.2, kv_scale=batch.kv_scale.to(device), selection=(chosen.to(device), lengths.to(device)),
                       tail=_on(device, tail)).cpu()  # fmt: skip
    check_eight_bit(got, want, torch.float32)
