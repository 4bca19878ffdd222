"""The hot-block cache's admission in one launch a layer (`server/kv_cache/hot_blocks.py`).

`HotLayer.admit` in torch is some forty small kernels a layer (gathers, scatters, a cumsum, the
ring's arithmetic); in a decode graph of 32 layers, at ~2 us each, ~2.5 ms a step, against the
~4-7 ms of link reads the cache saves at two 512K-token contexts. Here one program a KV head does
it all over the step's picks, in chunks of BLOCK, in two passes:

1. picks whose head of a host block the map holds are hits: their slots are marked read this step;
2. the other host picks (misses) take the ring's next slots in their order, at most `limit` a step,
   never a slot read this step; the block leaving a slot loses its map entry (unless the entry
   points elsewhere by now), the new block gets one, and the pick's (source, target) is written for
   `host_fill.fill_from_host`.

A program owns its head's rows of the map, owners, read stamps, ring pointer, clock and counts:
no atomics. Barriers order each chunk's stores before the next chunk's loads (the threads of a
program share nothing else). A block chosen twice in one step (two sequences sharing it) is
admitted once: the second pick finds the map updated (the torch admission gives it two slots;
either way the bytes read are the block's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import interpreting


@triton.jit
def _picks(chosen_ptr, tables_ptr, lengths_ptr, map_row, start, picks, per_seq, stride_cs, stride_ch, stride_t,
           head, first_host, BLOCK: tl.constexpr):  # fmt: skip
    """A chunk of this head's picks: index, host block (0 where none), whether a host block, held slot."""
    p = start + tl.arange(0, BLOCK)
    valid = p < picks
    seq = p // per_seq
    column = tl.load(chosen_ptr + seq * stride_cs + head * stride_ch + p % per_seq, mask=valid, other=0)
    page = tl.load(tables_ptr + seq * stride_t + column, mask=valid, other=0).to(tl.int64)
    selecting = tl.load(lengths_ptr + seq, mask=valid, other=0) > 0
    on_host = valid & selecting & (page >= first_host)
    block = tl.where(on_host, page - first_host, 0)
    held = tl.load(map_row + block, mask=on_host, other=-1).to(tl.int64)
    return p, valid, block, on_host, held


@triton.jit
def _admit_kernel(
    chosen_ptr, tables_ptr, lengths_ptr, map_ptr, owner_ptr, read_at_ptr, next_ptr, clock_ptr, counts_ptr,
    sources_ptr, targets_ptr, picks, per_seq, stride_cs, stride_ch, stride_t, stride_map, stride_slot,
    first_host, first_slot, slots, limit, none_block, BLOCK: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    map_row = map_ptr + head * stride_map
    owner_row = owner_ptr + head * stride_slot
    read_row = read_at_ptr + head * stride_slot
    now = tl.load(clock_ptr + head) + 1
    tl.store(clock_ptr + head, now)
    hits = tl.full([], 0, tl.int64)
    host = tl.full([], 0, tl.int64)
    for start in range(0, picks, BLOCK):  # 1: hits
        p, valid, block, on_host, held = _picks(chosen_ptr, tables_ptr, lengths_ptr, map_row, start, picks, per_seq,
                                                stride_cs, stride_ch, stride_t, head, first_host, BLOCK)  # fmt: skip
        hit = on_host & (held >= 0)
        tl.store(read_row + tl.where(hit, held - first_slot, 0), now + tl.zeros_like(held), mask=hit)
        hits += tl.sum(hit.to(tl.int64))
        host += tl.sum(on_host.to(tl.int64))
    tl.debug_barrier()
    ring = tl.load(next_ptr + head)
    taken = tl.full([], 0, tl.int64)
    for start in range(0, picks, BLOCK):  # 2: misses, in order
        p, valid, block, on_host, held = _picks(chosen_ptr, tables_ptr, lengths_ptr, map_row, start, picks, per_seq,
                                                stride_cs, stride_ch, stride_t, head, first_host, BLOCK)  # fmt: skip
        miss = on_host & (held < 0)
        rank = taken + tl.cumsum(miss.to(tl.int64), 0) - 1
        victim = (ring + tl.maximum(rank, 0)) % slots
        within = miss & (rank < limit)
        stamp = tl.load(read_row + victim, mask=within, other=0)
        admitted = within & (stamp < now)
        leaving = tl.load(owner_row + victim, mask=admitted, other=-1)
        was = admitted & (leaving >= 0)
        points = tl.load(map_row + tl.where(was, leaving, 0), mask=was, other=-1)
        tl.store(
            map_row + tl.where(was, leaving, 0),
            -1 + tl.zeros_like(points),
            mask=was & (points == victim + first_slot),
        )
        tl.store(map_row + block, (victim + first_slot).to(tl.int32), mask=admitted)
        tl.store(owner_row + victim, block, mask=admitted)
        tl.store(read_row + victim, now + tl.zeros_like(victim), mask=admitted)
        tl.store(sources_ptr + head * picks + p, tl.where(on_host, block, none_block), mask=valid)
        tl.store(targets_ptr + head * picks + p, tl.where(admitted, victim + first_slot, -1), mask=valid)
        taken += tl.sum(miss.to(tl.int64))
        tl.debug_barrier()
    tl.store(next_ptr + head, (ring + tl.minimum(taken, limit)) % slots)
    tl.store(counts_ptr + head * 2, tl.load(counts_ptr + head * 2) + hits)
    tl.store(counts_ptr + head * 2 + 1, tl.load(counts_ptr + head * 2 + 1) + host - hits)


def admit_triton(
    chosen: torch.Tensor,  # int64 [n, num_kv_heads, c]: block-table columns
    tables: torch.Tensor,  # int32 [n, width]
    lengths: torch.Tensor,  # int32 [n]: 0, the sequence does not select
    maps: torch.Tensor,  # int32 [num_kv_heads, host_blocks + 1]
    owner: torch.Tensor,  # int64 [num_kv_heads, slots + 1]
    read_at: torch.Tensor,  # int64 [num_kv_heads, slots + 1]
    ring: torch.Tensor,  # int64 [num_kv_heads]
    clock: torch.Tensor,  # int64 [num_kv_heads]
    counts: torch.Tensor,  # int64 [num_kv_heads, 2]
    first_host: int,
    first_slot: int,
    limit: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`HotLayer.admit` in one launch; returns (sources, targets) int64 [num_kv_heads, n * c]."""
    n, heads, per_seq = chosen.shape
    picks = n * per_seq
    sources = torch.empty(heads, picks, dtype=torch.int64, device=chosen.device)
    targets = torch.empty_like(sources)
    if picks == 0:
        return sources, targets
    assert chosen.stride(2) == 1 and tables.stride(1) == 1 and maps.stride(1) == 1 and owner.is_contiguous()
    assert read_at.stride() == owner.stride() and counts.is_contiguous()
    block = 16 if interpreting() else min(1024, triton.next_power_of_2(picks))
    _admit_kernel[(heads,)](
        chosen, tables, lengths, maps, owner, read_at, ring, clock, counts, sources, targets, picks, per_seq,
        chosen.stride(0), chosen.stride(1), tables.stride(0), maps.stride(0), owner.stride(0), first_host,
        first_slot, owner.shape[1] - 1, limit, maps.shape[1] - 1, BLOCK=block,
    )  # fmt: skip
    return sources, targets
