"""The hot-block cache (`kv_cache/hot_blocks.py`): host blocks selective decode chose are admitted,
per layer and KV head, into a ring of device blocks that decode then reads instead of the host
rows; a slot read this step is never given away; a host block written anew is forgotten."""

from __future__ import annotations

import torch

from tgserve.server.kv_cache.hot_blocks import HotBlockCache, admit_and_fill

FIRST_SLOT, SLOTS, HOST_BLOCKS = 10, 4, 6
FIRST_HOST = FIRST_SLOT + SLOTS
# One sequence: its first block on the device, then host blocks 0..5 (block-table columns 1..6).
TABLES = torch.tensor([[0] + [FIRST_HOST + i for i in range(HOST_BLOCKS)]], dtype=torch.int32)
SELECTING = torch.tensor([40], dtype=torch.int32)


def _cache() -> HotBlockCache:
    return HotBlockCache(2, 2, SLOTS, FIRST_SLOT, HOST_BLOCKS, torch.device("cpu"))


def _admit(cache: HotBlockCache, per_head: list[list[int]], layer: int = 0, lengths=SELECTING):
    """Admit host blocks `per_head[h]` chosen by head h; returns the device blocks given (-1: none)."""
    chosen = torch.tensor([[[1 + block for block in blocks] for blocks in per_head]])
    _, targets = cache.layers[layer].admit(chosen, TABLES, lengths)
    return targets.tolist()


def _held(cache: HotBlockCache, layer: int = 0) -> list[dict[int, int]]:
    """Per head, {host block: device block} as the map says."""
    rows = cache.layers[layer].map[:, :HOST_BLOCKS].tolist()
    return [{block: slot for block, slot in enumerate(row) if slot >= 0} for row in rows]


def test_chosen_host_blocks_are_admitted_then_read_as_hits():
    cache = _cache()
    assert _admit(cache, [[0, 1], [2, 3]]) == [[10, 11], [10, 11]]
    assert _held(cache) == [{0: 10, 1: 11}, {2: 10, 3: 11}]
    assert _admit(cache, [[1, 0], [3, 2]]) == [[-1, -1], [-1, -1]]  # all held: nothing to copy
    assert cache.layers[0].counts.sum(0).tolist() == [4, 4] and _held(cache, layer=1) == [{}, {}]
    assert _admit(cache, [[2, 3], [2, 3]]) == [[12, 13], [-1, -1]]
    assert _held(cache)[0] == {0: 10, 1: 11, 2: 12, 3: 13}


def test_the_ring_gives_the_oldest_slot_but_never_one_read_this_step():
    cache = _cache()
    _admit(cache, [[0, 1], [0, 1]])
    _admit(cache, [[2, 3], [2, 3]])  # every slot taken; head 0's ring is back at slot 10 (block 0)
    # Block 0 is read this step: its slot is not given to block 4, which is read over the link.
    assert _admit(cache, [[0, 4], [0, 4]]) == [[-1, -1], [-1, -1]]
    assert _held(cache)[0] == {0: 10, 1: 11, 2: 12, 3: 13}
    # The next step block 4 takes slot 11, the next in the ring; block 1 leaves.
    assert _admit(cache, [[4, 2], [4, 2]]) == [[11, -1], [11, -1]]
    assert _held(cache)[0] == {0: 10, 2: 12, 3: 13, 4: 11}


def test_at_most_half_the_slots_are_admitted_a_step():
    cache = _cache()
    assert _admit(cache, [[0, 1, 2, 3], [5, 4, 3, 2]]) == [[10, 11, -1, -1], [10, 11, -1, -1]]
    assert cache.layers[0].counts.sum(0).tolist() == [0, 8]


def test_sequences_that_do_not_select_admit_nothing():
    cache = _cache()
    assert _admit(cache, [[0, 1], [2, 3]], lengths=torch.tensor([0], dtype=torch.int32)) == [[-1, -1]] * 2
    assert cache.layers[0].counts.sum(0).tolist() == [0, 0]


def test_a_host_block_written_anew_is_forgotten_by_every_layer():
    cache = _cache()
    _admit(cache, [[0, 1], [0, 2]], layer=0)
    _admit(cache, [[0], [3]], layer=1)
    cache.forget(torch.tensor([0, 3]))
    assert _held(cache, 0) == [{1: 11}, {2: 11}] and _held(cache, 1) == [{}, {}]
    # Chosen again, block 0 is a miss and gets a new slot; the stale slot 10 frees in turn.
    assert _admit(cache, [[0, 1], [0, 2]]) == [[12, -1], [12, -1]]


def test_admission_copies_the_heads_it_admits_into_their_device_blocks():
    cache = _cache()
    kv_cache = torch.zeros(2, FIRST_HOST, 4, 2, 8)
    host = torch.randn(2, HOST_BLOCKS, 4, 2, 8)
    chosen = torch.tensor([[[1 + 3], [1 + 5]]])  # head 0 chose host block 3, head 1 block 5
    admit_and_fill(cache.layers[0], chosen, TABLES, SELECTING, kv_cache, None, host, None)
    assert torch.equal(kv_cache[:, 10, :, 0], host[:, 3, :, 0]) and torch.equal(
        kv_cache[:, 10, :, 1], host[:, 5, :, 1]
    )
    assert not kv_cache[:, 11:].any()
