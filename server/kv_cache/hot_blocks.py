"""The hot-block cache: host-tier blocks that selective decode keeps choosing, kept in device blocks.

A context partly spilled to the host tier decodes over the blocks selection chooses, wherever they
lie; the chosen host blocks cross the link every step and layer (two 512K-token contexts of
Llama-3-8B: ~440 MiB a step, ~8.6 ms of a 19.2 ms step; docs/benchmarks/2026-12-04-host-key-copies-h200.md).
Decode queries move slowly, so the choices repeat: with SmolLM2's real weights 88% of a step's
chosen blocks were chosen in one of the four steps before, with random weights ~50%
(docs/benchmarks/2026-12-04-selection-reuse.md). This cache keeps recently chosen host blocks in
spare device blocks, so that a block chosen again is read from device memory.

Selection chooses per KV head, so the cache holds single heads: per layer with key summaries and
per KV head, `slots` device blocks (the pool's blocks after the block manager's, before the first
host id) each hold that head of one host block. After selection, each step's admission:

- a chosen host block whose head is held is a hit: `paged_decode`'s `hot` map sends the read to the
  device block; its slot is marked read this step;
- the misses take the next slots of the (layer, head)'s ring, at most half the slots a step, never
  a slot read this step (its block is being read now); `dispatch.fill_from_host` copies them in
  before decode reads them. A miss left out is read over the link, as without the cache.

A ring (FIFO) rather than LRU: its victims need no sort, and a block lives in it for
slots / (misses a step) steps, longer than the four steps over which choices were measured to repeat.
Every tensor is on the device and of a fixed shape: no host sync, so the decode graph captures the
admission. A host block written anew (an offload into it) loses its entries (`forget`).

Layouts, per layer: map int32 [num_kv_heads, host_blocks + 1] (the device block holding that head
of a host block, or -1; the last column takes the writes of picks that are not host blocks);
owner int64 [num_kv_heads, slots + 1] (the host block in each slot, or -1; the last column
likewise), read_at int64 [num_kv_heads, slots + 1] (the admission that last read the slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgserve.kernels import dispatch

# The admission in one Triton launch a layer on CUDA (`kernels/hot_admission.py`) instead of some forty
# small torch kernels: two 512K-token contexts on an H200 decode at 18.70 ms a step with it, 23.61
# with the torch admission (docs/benchmarks/2026-12-05-families-and-selection-h200.md).
ADMIT_IN_ONE_KERNEL = True


@dataclass(frozen=True)
class HotLayer:
    """One layer's share of the cache."""

    map: torch.Tensor
    owner: torch.Tensor
    read_at: torch.Tensor
    next: torch.Tensor  # int64 [num_kv_heads]: each ring's next slot
    clock: torch.Tensor  # int64 [num_kv_heads]: admissions so far (a clock a head: see hot_admission.py)
    counts: torch.Tensor  # int64 [num_kv_heads, 2]: chosen host blocks found held (hits), and not (misses)
    first_slot: int  # the device block of slot 0
    first_host: int  # the first host id of the block tables

    @property
    def slots(self) -> int:
        return self.owner.shape[1] - 1

    @property
    def none_block(self) -> int:
        return self.map.shape[1] - 1

    @property
    def limit(self) -> int:
        """Misses admitted a step, at most: half the slots, so a block stays at least two steps."""
        return max(1, self.slots // 2)

    def admit(
        self, chosen: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Account for a step's choice and admit its misses: chosen int64 [n, num_kv_heads, c]
        block-table columns of `tables` [n, width], lengths [n] (0: the sequence does not select,
        its columns are not read). Returns (host blocks, device blocks or -1), int64 [num_kv_heads,
        n * c]: what `dispatch.fill_from_host` must copy before decode reads the map. On CUDA with
        ADMIT_IN_ONE_KERNEL, `kernels/hot_admission.py` does it in one launch."""
        if ADMIT_IN_ONE_KERNEL and chosen.is_cuda:
            from tgserve.kernels.hot_admission import admit_triton

            return admit_triton(chosen, tables, lengths, self.map, self.owner, self.read_at, self.next, self.clock,
                                self.counts, self.first_host, self.first_slot, self.limit)  # fmt: skip
        blocks, on_host = self._host_blocks(chosen, tables, lengths)
        held = self.map.gather(1, blocks).long()
        hit = on_host & (held >= 0)
        self.clock.add_(1)
        now = self.clock[:, None].expand(blocks.shape)
        self.read_at.scatter_(1, torch.where(hit, held - self.first_slot, self.slots), now)
        miss = on_host & ~hit
        slot = self._take_slots(blocks, miss, now)
        self.counts.add_(torch.stack([hit.sum(1), miss.sum(1)], dim=1))
        return blocks, torch.where(slot < self.slots, slot + self.first_slot, -1)

    def _host_blocks(
        self, chosen: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head, each pick's host block (none_block where it is not one) and whether it is,
        [num_kv_heads, n * c]."""
        n, heads, c = chosen.shape
        pages = tables.long().gather(1, chosen.reshape(n, heads * c)).view(n, heads, c)
        on_host = (pages >= self.first_host) & (lengths > 0).view(n, 1, 1)
        blocks = torch.where(on_host, pages - self.first_host, self.none_block)
        return blocks.transpose(0, 1).reshape(heads, -1), on_host.transpose(0, 1).reshape(heads, -1)

    def _take_slots(self, blocks: torch.Tensor, miss: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        """The misses' slots from the ring, in order (`slots` where a miss is not admitted: past the
        limit, or its slot was read this step); the blocks leaving lose their map entries."""
        none, limit = self.slots, self.limit
        rank = miss.long().cumsum(1) - 1
        victim = (self.next[:, None] + rank.clamp(min=0)) % self.slots
        admitted = miss & (rank < limit) & (self.read_at.gather(1, victim) < now)
        slot = torch.where(admitted, victim, none)
        # The blocks leaving: their map entries go, unless they point at another slot by now.
        leaving = self.owner.gather(1, slot)
        leaving = torch.where(leaving >= 0, leaving, self.none_block)
        still_here = self.map.gather(1, leaving).long() == slot + self.first_slot
        self.map.scatter_(1, torch.where(admitted & still_here, leaving, self.none_block), -1)
        self.map.scatter_(1, torch.where(admitted, blocks, self.none_block), (slot + self.first_slot).int())
        self.owner.scatter_(1, slot, torch.where(admitted, blocks, -1))
        self.read_at.scatter_(1, slot, now)
        self.next.copy_((self.next + miss.sum(1).clamp(max=limit)) % self.slots)
        return slot


class HotBlockCache:
    """Every selecting layer's `HotLayer`, over one map tensor (`forget` clears a block in all)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        slots: int,
        first_slot: int,
        host_blocks: int,
        device: torch.device,
    ) -> None:
        assert slots > 0
        self.maps = torch.full(
            (num_layers, num_kv_heads, host_blocks + 1), -1, dtype=torch.int32, device=device
        )
        first_host = first_slot + slots
        self.layers = [
            HotLayer(
                map=self.maps[i],
                owner=torch.full((num_kv_heads, slots + 1), -1, dtype=torch.int64, device=device),
                read_at=torch.zeros(num_kv_heads, slots + 1, dtype=torch.int64, device=device),
                next=torch.zeros(num_kv_heads, dtype=torch.int64, device=device),
                clock=torch.zeros(num_kv_heads, dtype=torch.int64, device=device),
                counts=torch.zeros(num_kv_heads, 2, dtype=torch.int64, device=device),
                first_slot=first_slot,
                first_host=first_host,
            )
            for i in range(num_layers)
        ]

        # `recent_counts`: the totals copied to host memory without waiting, and when that copy is done.
        self._on_host = torch.zeros(2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self._seen = (0, 0)

    @property
    def slots(self) -> int:
        return self.layers[0].slots

    def forget(self, host_ids: torch.Tensor) -> None:
        """Host blocks `host_ids` (int64, on the device) are being written anew: no layer holds them now."""
        self.maps.index_fill_(2, host_ids, -1)

    def _totals(self) -> torch.Tensor:
        return torch.stack([layer.counts for layer in self.layers]).sum((0, 1))

    def counts(self) -> tuple[int, int]:
        """(hits, misses) over every layer so far: chosen host blocks read from the device and not
        (waits for the device: for benchmarks and tests)."""
        hits, misses = self._totals().tolist()
        return hits, misses

    def recent_counts(self) -> tuple[int, int]:
        """`counts` as of an earlier call on CUDA, without waiting for the device (the engine's stats
        go out every second while it steps; a read that waited would stall the step in flight):
        each call starts a copy to host memory that a later call reads once it is done."""
        if self.maps.device.type != "cuda":
            return self.counts()
        if self._copied is not None and self._copied.query():
            hits, misses = self._on_host.tolist()
            self._seen, self._copied = (hits, misses), None
        if self._copied is None:
            self._on_host.copy_(self._totals(), non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._seen

    def reset_counts(self) -> None:
        for layer in self.layers:
            layer.counts.zero_()
        self._seen = (0, 0)


def admit_and_fill(
    hot: HotLayer,
    chosen: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    host_cache: torch.Tensor,
    host_scale: torch.Tensor | None,
) -> None:
    """A layer's admission (`HotLayer.admit`) and the copies it asks for, before its decode reads."""
    sources, targets = hot.admit(chosen, tables, lengths)
    dispatch.fill_from_host(kv_cache, kv_scale, host_cache, host_scale, sources, targets)
