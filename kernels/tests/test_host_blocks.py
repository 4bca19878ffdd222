"""Decode over block tables that name host blocks (the long-context tier's read path): entries past
the device pool's block count are host blocks, read in place from the host tier's rows
(`HostKVPool.layer_views`; pinned host memory on CUDA). The output is the
one the same blocks give from the device pool, bit for bit, and the twin reads them the same way."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import reference
from tgserve.kernels.block_scores import block_scores, candidate_scores
from tgserve.kernels.host_fill import fill_from_host
from tgserve.kernels.kv_format import dequantize_kv, quantize_kv
from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.paged_prefill import paged_prefill
from tgserve.kernels.testing import PagedBatch, make_paged_batch, with_8_bit_cache


def _host_copy(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """An empty host twin [2, num_blocks, ...] of a pool tensor, strided by block as the host tier's
    rows are (`HostKVPool.layer_views`), pinned when the pool is on CUDA."""
    rows = torch.empty(num_blocks, 3, *tensor.shape[2:], dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    return rows[:, :2].transpose(0, 1)


def _moved_to_host(batch: PagedBatch, every: int) -> tuple[torch.Tensor, tuple, list[tuple[int, int]]]:
    """Every `every`-th block of each table (the current one kept) copied to host blocks, its table
    entry pointed there and its device copy poisoned: (the new tables, the host view, the moves)."""
    num_blocks, block_size = batch.kv_cache.shape[1], batch.kv_cache.shape[2]
    tables = batch.block_tables.clone()
    moves = []
    for seq, length in enumerate(batch.seq_lens.tolist()):
        for column in range(0, (length - 1) // block_size, every):
            moves.append((int(tables[seq, column]), len(moves)))
            tables[seq, column] = num_blocks + moves[-1][1]
    host_cache = _host_copy(batch.kv_cache, len(moves) + 2)
    host_scale = None if batch.kv_scale is None else _host_copy(batch.kv_scale, len(moves) + 2)
    for device_block, host_block in moves:
        host_cache.view(torch.uint8)[:, host_block] = batch.kv_cache.view(torch.uint8)[:, device_block].cpu()
        batch.kv_cache.view(torch.uint8)[:, device_block] = 0x7F  # NaN in e4m3 and f16, 3e38 in f32
        if host_scale is not None:
            host_scale[:, host_block] = batch.kv_scale[:, device_block].cpu()
            batch.kv_scale[:, device_block] = float("nan")
    return tables, (host_cache, host_scale, num_blocks), moves


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_reads_host_blocks_where_they_lie(device, dtype, fp8, splits):
    seq_lens = [1, 9, 40, 77]
    batch = make_paged_batch([1] * 4, seq_lens, 8, 2, 32, 8, dtype, device, seed=5)
    if fp8:
        batch = with_8_bit_cache(batch)
    args = (batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3)
    want = paged_decode(*args, num_splits=splits, kv_scale=batch.kv_scale)
    tables, host, moves = _moved_to_host(batch, every=2)
    assert moves, "the batch should have blocks to move"
    got = paged_decode(batch.query, batch.kv_cache, tables, batch.seq_lens, 0.3, num_splits=splits,
                       kv_scale=batch.kv_scale, host=host)  # fmt: skip
    assert torch.equal(got, want)
    twin = reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), tables.cpu(),
                                     torch.arange(5, dtype=torch.int32), batch.seq_lens.cpu(), 0.3,
                                     kv_scale=None if batch.kv_scale is None else batch.kv_scale.cpu(),
                                     host=(host[0].cpu(), None if host[1] is None else host[1].cpu(), host[2]))  # fmt: skip
    assert torch.isfinite(twin).all() and (twin - want.cpu().float()).abs().max() < 5e-3


def test_selective_decode_reads_chosen_host_blocks(device):
    batch = make_paged_batch([1, 1], [200, 97], 8, 2, 32, 8, torch.float32, device, seed=6)
    # Each KV head keeps three blocks of its own (block-table columns) and the current one.
    chosen = torch.tensor([[[0, 5, 9], [2, 3, 20]], [[1, 4, 7], [0, 6, 10]]], device=device)
    lengths = torch.tensor(
        [3 * 8 + (200 - 1) % 8 + 1, 3 * 8 + (97 - 1) % 8 + 1], dtype=torch.int32, device=device
    )
    args = (batch.query, batch.kv_cache)
    want = paged_decode(*args, batch.block_tables, batch.seq_lens, 0.3, selection=(chosen, lengths))
    tables, host, _ = _moved_to_host(batch, every=1)  # every block but the current one on host
    got = paged_decode(*args, tables, batch.seq_lens, 0.3, selection=(chosen, lengths), host=host)
    assert torch.equal(got, want)
    twin = reference.selected_decode(batch.query.cpu(), batch.kv_cache.cpu(), tables.cpu(), batch.seq_lens.cpu(),
                                     chosen.cpu(), lengths.cpu(), 0.3, host=(host[0].cpu(), None, host[2]))  # fmt: skip
    assert (twin - want.cpu()).abs().max() < 2e-5


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, True)])
def test_prefill_chunks_read_host_blocks_where_they_lie(device, dtype, fp8):
    """A prompt chunk after a context whose older blocks are on host (a long prompt prefilled in
    chunks while it spills): the paged prefill reads them in place."""
    batch = make_paged_batch([5, 12, 1], [40, 77, 30], 8, 2, 32, 8, dtype, device, seed=7)
    if fp8:
        batch = with_8_bit_cache(batch)
    args = (batch.query, batch.kv_cache)
    rest = (batch.query_start_loc, batch.seq_lens, 0.3)
    want = paged_prefill(*args, batch.block_tables, *rest, kv_scale=batch.kv_scale)
    tables, host, moves = _moved_to_host(batch, every=2)
    assert moves
    got = paged_prefill(*args, tables, *rest, kv_scale=batch.kv_scale, host=host)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", [False, True])
def test_block_selection_reads_host_summaries_and_keys(device, fp8):
    """Selective decode's two scoring launches (bounds from key summaries, candidates' true logits
    from their keys) pick the same blocks when the cold ones lie on host."""
    from tgserve.kernels import dispatch
    from tgserve.kernels.decode_selection import DecodeSelection

    batch = make_paged_batch([1, 1], [300, 170], 8, 2, 32, 8, torch.float16, device, seed=8)
    summary = torch.randn(2, batch.kv_cache.shape[1], 2, 32, generator=torch.Generator().manual_seed(9))
    summary = torch.stack([summary.min(0).values, summary.max(0).values]).to(torch.float16).to(device)
    if fp8:
        batch = with_8_bit_cache(batch)
    selection = DecodeSelection(budget=96, min_context=64, sink=8, recent=16)
    args = (batch.query, summary)
    rest = (batch.seq_lens, selection, batch.kv_cache, batch.kv_scale)
    want = dispatch.select_decode_blocks(*args, batch.block_tables, *rest)
    tables, (host_cache, host_scale, first), moves = _moved_to_host(batch, every=3)
    host_summary = _host_copy(summary, len(moves) + 2)
    for device_block, host_block in moves:
        host_summary[:, host_block] = summary[:, device_block].cpu()
        summary[:, device_block] = float("nan")
    got = dispatch.select_decode_blocks(
        *args, tables, *rest, host=(host_cache, host_scale, host_summary, first, None)
    )
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    # The Triton launches themselves (dispatch takes the twins off CUDA), against the twins.
    bound = block_scores(
        batch.query, summary, tables, batch.seq_lens, 8, 1, 2, host_summary=(host_summary, first)
    )
    twin = reference.block_scores(batch.query.cpu(), summary.cpu(), tables.cpu(), batch.seq_lens.cpu(), 8, 1, 2,
                                  host_summary=(host_summary.cpu(), first))  # fmt: skip
    assert torch.allclose(bound.cpu(), twin, atol=1e-2, rtol=1e-3)
    columns = torch.topk(twin, 6, dim=-1).indices.to(device)
    exact = candidate_scores(batch.query, batch.kv_cache, tables, columns, bound, batch.kv_scale,
                             host=(host_cache, host_scale, first))  # fmt: skip
    twin_exact = reference.candidate_scores(
        batch.query.cpu(), batch.kv_cache.cpu(), tables.cpu(), columns.cpu(), bound.cpu(),
        None if batch.kv_scale is None else batch.kv_scale.cpu(),
        host=(host_cache.cpu(), None if host_scale is None else host_scale.cpu(), first),
    )  # fmt: skip
    assert torch.isfinite(twin_exact[~torch.isinf(twin_exact)]).all()
    assert torch.allclose(exact.cpu(), twin_exact, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
def test_candidate_rescoring_reads_device_key_copies_of_host_blocks(device, dtype, fp8):
    """Host blocks with a key copy on the device (`server/kv_cache/key_copies.py`: e4m3 keys, a
    scale a token and KV head) are rescored from the copy, never from host memory (poisoned here),
    and score as their copy's keys would in the device pool; the others are read on host."""
    batch = make_paged_batch([1, 1], [300, 170], 8, 2, 32, 8, dtype, device, seed=8)
    if fp8:
        batch = with_8_bit_cache(batch)
    original, original_scale = (
        batch.kv_cache.clone(),
        None if batch.kv_scale is None else batch.kv_scale.clone(),
    )
    tables, (host_cache, host_scale, first), moves = _moved_to_host(batch, every=2)
    copied_moves = moves[1::2]  # every other host block has a copy; slots in reverse order
    slots = len(copied_moves) + 1
    slot_of = torch.full((host_cache.shape[1],), -1, dtype=torch.int32)
    copy_keys = torch.zeros(slots, *original.shape[2:], dtype=torch.float8_e4m3fn)
    copy_scales = torch.zeros(slots, original.shape[3], original.shape[2])
    reference_cache = original.clone()  # the device pool as the copies' keys would make it
    for i, (device_block, host_block) in enumerate(copied_moves):
        slot = slots - 1 - i
        slot_of[host_block] = slot
        if fp8:
            keys, scales = original[0, device_block].cpu(), original_scale[0, device_block].cpu()
        else:
            keys, row_scales = quantize_kv(original[0, device_block].float().cpu())
            scales = row_scales.transpose(0, 1)  # [KV heads, block_size], as the copies keep them
            reference_cache[0, device_block] = dequantize_kv(keys, row_scales).to(dtype).to(device)
        copy_keys.view(torch.uint8)[slot] = keys.view(torch.uint8)
        copy_scales[slot] = scales
        host_cache.view(torch.uint8)[0, host_block] = 0x7F  # what a read over the link would find
    key_copy = (copy_keys.to(device), copy_scales.to(device), slot_of.to(device))
    bound = torch.zeros(2, 2, tables.shape[1], device=device)
    columns = torch.stack(
        [torch.randperm(17, generator=torch.Generator().manual_seed(s))[:8] for s in (1, 2)]
    )
    columns = columns[:, None, :].expand(2, 2, 8).contiguous().to(device)
    got = candidate_scores(batch.query, batch.kv_cache, tables, columns, bound, batch.kv_scale,
                           host=(host_cache, host_scale, first), key_copy=key_copy)  # fmt: skip
    twin = reference.candidate_scores(
        batch.query.cpu(), batch.kv_cache.cpu(), tables.cpu(), columns.cpu(), bound.cpu(),
        None if batch.kv_scale is None else batch.kv_scale.cpu(),
        host=(host_cache.cpu(), None if host_scale is None else host_scale.cpu(), first),
        key_copy=tuple(t.cpu() for t in key_copy),
    )  # fmt: skip
    pooled = reference.candidate_scores(
        batch.query.cpu(), reference_cache.cpu(), batch.block_tables.cpu(), columns.cpu(), bound.cpu(),
        None if original_scale is None else original_scale.cpu(),
    )  # fmt: skip
    assert torch.isfinite(twin).all()
    assert (
        torch.equal(twin, pooled)
        if dtype == torch.float32 or fp8
        else torch.allclose(twin, pooled, atol=2e-2)
    )
    assert torch.allclose(got.cpu(), twin, atol=2e-2 if dtype == torch.float16 else 1e-4, rtol=1e-3)


def _with_spare_blocks(batch: PagedBatch, count: int) -> PagedBatch:
    """The batch with `count` NaN-poisoned device blocks appended to its pool (and its scales)."""
    cache = batch.kv_cache
    spare = torch.full((2, count, *cache.shape[2:]), float("nan"), device=cache.device).to(cache.dtype)
    scale = batch.kv_scale
    if scale is not None:
        scale = torch.cat(
            [scale, torch.full((2, count, *scale.shape[2:]), float("nan"), device=scale.device)], 1
        )
    joined = torch.cat([cache.view(torch.uint8), spare.view(torch.uint8)], dim=1).view(cache.dtype)
    return PagedBatch(batch.query, batch.key, batch.value, joined, batch.block_tables, batch.query_start_loc,
                      batch.seq_lens, batch.slot_mapping, scale)  # fmt: skip


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
def test_fill_from_host_copies_the_chosen_heads_of_host_blocks(device, dtype, fp8):
    batch = make_paged_batch([1, 1], [64, 40], 8, 2, 32, 8, dtype, device, seed=11)
    if fp8:
        batch = with_8_bit_cache(batch)
    batch = _with_spare_blocks(batch, 6)
    first = batch.kv_cache.shape[1]
    tables, host, moves = _moved_to_host(batch, every=1)
    # Head 0 takes host blocks 0, 2 and 4 into slots first-6.., head 1 host block 1; the rest nothing.
    sources = torch.tensor([[0, 2, 4, 3], [1, 0, 0, 0]], device=device)
    targets = torch.tensor([[first - 6, first - 5, first - 4, -1], [first - 3, -1, -1, -1]], device=device)
    want_cache, want_scale = (
        batch.kv_cache.cpu().clone(),
        None if batch.kv_scale is None else batch.kv_scale.cpu().clone(),
    )
    reference.fill_from_host(want_cache, want_scale, host[0].cpu(), None if host[1] is None else host[1].cpu(),
                             sources.cpu(), targets.cpu())  # fmt: skip
    fill_from_host(batch.kv_cache, batch.kv_scale, host[0], host[1], sources, targets)
    got = batch.kv_cache.cpu()
    assert torch.equal(got.view(torch.uint8), want_cache.view(torch.uint8))
    # What was copied is the host block's head, and only it.
    assert torch.equal(got[:, first - 6, :, 0].view(torch.uint8), host[0][:, 0, :, 0].cpu().view(torch.uint8))
    assert torch.isnan(got[:, first - 6, :, 1].float()).all() and torch.isnan(got[:, first - 2].float()).all()
    if fp8:
        assert torch.allclose(batch.kv_scale.cpu(), want_scale, equal_nan=True)
        assert torch.equal(batch.kv_scale.cpu()[:, first - 3, 1], host[1][:, 1, 1].cpu())


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, True)])
def test_selective_decode_reads_held_host_blocks_on_the_device(device, dtype, fp8):
    """Host blocks whose head the hot-block map holds are read from that device block: their host
    rows poisoned for that head, the output is still the all-device one, bit for bit."""
    batch = make_paged_batch([1, 1], [200, 97], 8, 2, 32, 8, dtype, device, seed=6)
    if fp8:
        batch = with_8_bit_cache(batch)
    chosen = torch.tensor([[[0, 5, 9], [2, 3, 20]], [[1, 4, 7], [0, 6, 10]]], device=device)
    lengths = torch.tensor(
        [3 * 8 + (200 - 1) % 8 + 1, 3 * 8 + (97 - 1) % 8 + 1], dtype=torch.int32, device=device
    )
    args = (batch.query,)
    want = paged_decode(*args, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.3,
                        selection=(chosen, lengths), kv_scale=batch.kv_scale)  # fmt: skip
    batch = _with_spare_blocks(batch, 8)
    first = batch.kv_cache.shape[1]
    tables, host, _ = _moved_to_host(batch, every=1)
    # Head h of each sequence's first two chosen blocks held in slots; their host rows poisoned.
    hot = torch.full((2, host[0].shape[1] + 1), -1, dtype=torch.int32, device=device)
    sources, targets = [], []
    for head in (0, 1):
        picks = [int(tables[s, chosen[s, head, j]]) - first for s in (0, 1) for j in (0, 1)]
        slots = [first - 8 + 4 * head + i for i in range(4)]
        hot[head, picks] = torch.tensor(slots, dtype=torch.int32, device=device)
        sources.append(picks)
        targets.append(slots)
    sources, targets = torch.tensor(sources, device=device), torch.tensor(targets, device=device)
    fill_from_host(batch.kv_cache, batch.kv_scale, host[0], host[1], sources, targets)
    for head in (0, 1):
        host[0].view(torch.uint8)[:, sources[head].cpu(), :, head] = 0x7F
        if fp8:  # (e4m3's NaN need not survive the widening to f16: the scales carry the poison)
            host[1][:, sources[head].cpu(), head] = float("nan")
    kwargs = dict(selection=(chosen, lengths), kv_scale=batch.kv_scale, host=host)
    got = paged_decode(*args, batch.kv_cache, tables, batch.seq_lens, 0.3, hot=hot, **kwargs)
    assert torch.equal(got, want)
    unheld = paged_decode(*args, batch.kv_cache, tables, batch.seq_lens, 0.3, **kwargs)
    assert not torch.isfinite(unheld).all(), "without the map the poisoned host rows are read"
    twin = reference.selected_decode(batch.query.cpu(), batch.kv_cache.cpu(), tables.cpu(), batch.seq_lens.cpu(),
                                     chosen.cpu(), lengths.cpu(), 0.3,
                                     kv_scale=None if batch.kv_scale is None else batch.kv_scale.cpu(),
                                     host=(host[0].cpu(), None if host[1] is None else host[1].cpu(), host[2]),
                                     hot=hot.cpu())  # fmt: skip
    assert (twin - want.cpu().float()).abs().max() < 5e-3


def test_admission_in_one_kernel_equals_the_torch_admission(device):
    """The hot-block cache's admission (`kernels/hot_admission.py`) against `HotLayer.admit` in
    torch, over steps of four sequences (one not selecting) choosing five columns each a KV head:
    the same copies asked for and the same state after every step (two chunks of picks a head in
    the interpreter, so the ranks carry over)."""
    from tgserve.kernels.hot_admission import admit_triton
    from tgserve.server.kv_cache.hot_blocks import HotBlockCache

    first_slot, slots, host_blocks = 30, 6, 40
    first_host = first_slot + slots
    gen = torch.Generator().manual_seed(3)
    # Each sequence's own host blocks (10 apiece) among device blocks, so no two picks of a head
    # name the same block in a step.
    tables = torch.zeros(4, 14, dtype=torch.int32)
    for seq in range(4):
        tables[seq, :10] = first_host + seq * 10 + torch.randperm(10, generator=gen).to(torch.int32)
        tables[seq, 10:] = torch.randint(0, first_slot, (4,), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([50, 50, 0, 50], dtype=torch.int32)
    want = HotBlockCache(1, 2, slots, first_slot, host_blocks, torch.device("cpu")).layers[0]
    got = HotBlockCache(1, 2, slots, first_slot, host_blocks, torch.device(device)).layers[0]
    for _ in range(8):
        chosen = torch.stack(
            [torch.stack([torch.randperm(14, generator=gen)[:5] for _ in range(2)]) for _ in range(4)]
        )
        sources, targets = want.admit(chosen, tables, lengths)
        on = {name: getattr(got, name) for name in ("map", "owner", "read_at", "next", "clock", "counts")}
        got_sources, got_targets = admit_triton(chosen.to(device), tables.to(device), lengths.to(device),
                                                on["map"], on["owner"], on["read_at"], on["next"], on["clock"],
                                                on["counts"], first_host, first_slot, got.limit)  # fmt: skip
        assert torch.equal(got_targets.cpu(), targets) and torch.equal(got_sources.cpu(), sources)
        for name, tensor in on.items():
            mine = getattr(want, name)
            live = tensor[:, :-1] if name in ("map", "owner", "read_at") else tensor  # not the writes' sink
            assert torch.equal(live.cpu(), mine[:, :-1] if name in ("map", "owner", "read_at") else mine), (
                name
            )
    assert int(want.counts[:, 0].sum()) > 0 and int(want.counts[:, 1].sum()) > 0
