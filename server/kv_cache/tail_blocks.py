"""An 8-bit cache's full-precision tail: each sequence's current block kept in the model's dtype too.

An e4m3 cache rounds every key to three mantissa bits, and the keys a decoding query weighs most
are its latest ones: on SmolLM2 (float32, CPU) an fp8 cache agreed with the full-precision one on
989 of 1,024 greedy steps; with the tail, 1,003 (int8: 1,007 and 1,013;
docs/benchmarks/2026-12-06-kv-tail-agreement-cpu.md). This is KIVI's full-precision residual at
block granularity: the block being filled is read at full precision, and it is read from the 8-bit
pool once the sequence has moved past it.

The rule every backend follows, so that each reads what the CPU twin reads:
- every row written into a block that has a tail slot (`slot_of[block] >= 0`) is also written
  there, unquantized; the pool gets every row as always (the host tier, prefix caching, key
  summaries and block selection read the pool alone);
- a sequence's current block (the one holding its last position this step) is read from its tail
  slot where it has one; every other block, and a current block without a slot, from the pool.

Slots are given by the runner before each step (`plan_step`): a running request holds one slot,
moved to its current block as it fills blocks. Rows of that block written before the request took
the slot (a resumed request, a prefix-cache hit on its last block) are filled from the pool, at
its precision. A request's slot on a full block is given up at the next step, so a block that
other requests may share (a full one, through the prefix cache) never reads differently from the
pool for them. Without a free slot a block simply has none and is read from the pool.

Layouts (per layer with an 8-bit cache): cache [2, slots, block_size, num_kv_heads, head_dim] in
the model's dtype; `slot_of` int32 [pool blocks], shared by every layer: a block's slot or -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgserve.kernels.kv_format import dequantize_kv
from tgserve.server.device.transfer import to_device


@dataclass(frozen=True)
class LayerTail:
    """One layer's tail slots and the block -> slot map every layer shares."""

    cache: torch.Tensor  # [2, slots, block_size, num_kv_heads, head_dim], the model's dtype
    slot_of: torch.Tensor  # int32 [pool blocks]: -1 where a block has no slot

    @property
    def as_kernel_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache, self.slot_of


def tail_bytes(specs: list, block_size: int, slots: int, dtype: torch.dtype) -> int:
    """Device memory of `slots` tail slots across the layers with an 8-bit cache of their own."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(
        slots * 2 * block_size * spec.num_kv_heads * spec.head_dim * element
        for spec in specs
        if spec.scaled and spec.reads_kv_of is None
    )


@dataclass
class _Held:
    slot: int
    block: int | None = None  # the block the slot serves, None once given up
    full: bool = False  # the block was full after the request's last step


class TailBlocks:
    """Every 8-bit layer's tail slots, and which request's current block each one serves."""

    def __init__(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], slots: int, dtype: torch.dtype
    ) -> None:
        """layers: each 8-bit layer's (cache [2, blocks, block_size, H_kv, D], scales), the pool the
        slots are filled from; a layer listed twice (one that reads another's cache) shares its tail."""
        cache = layers[0][0]
        self.block_size = cache.shape[2]
        self.slot_of = torch.full((cache.shape[1],), -1, dtype=torch.int32, device=cache.device)
        # Each pool once, with its scales and its own tail: what a slot's rows are filled from.
        self._own: dict[int, tuple[torch.Tensor, torch.Tensor, LayerTail]] = {}
        for pool, scale in layers:
            if id(pool) not in self._own:
                tail = torch.zeros(2, slots, *pool.shape[2:], dtype=dtype, device=pool.device)
                self._own[id(pool)] = (pool, scale, LayerTail(tail, self.slot_of))
        self.layers: list[LayerTail] = [self._own[id(pool)][2] for pool, _ in layers]
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[str, _Held] = {}
        self._owner: dict[int, str] = {}  # block -> the request whose slot serves it

    @property
    def num_slots(self) -> int:
        return self.layers[0].cache.shape[1]

    def release(self, request_id: str) -> None:
        """A finished or preempted request gives its slot back."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._unmap(request_id, held)
            self._free.append(held.slot)

    def plan_step(self, current: list[tuple[str, int, int, int]]) -> None:
        """Before a step: each scheduled request's (id, current block, rows of it written before
        the step, rows after it) gets that block mapped to its slot. Queued on the device before
        the step's forward; nothing waits for the device."""
        changes: dict[int, int] = {}
        scheduled = {request_id for request_id, *_ in current}
        for request_id, held in list(self._held.items()):
            if held.full and request_id not in scheduled:  # a full block may be shared: the pool's
                self._unmap(request_id, held, changes)
        fills = []
        for request_id, block, before, after in current:
            if block >= self.slot_of.shape[0]:  # a host-tier block (never a current one): the pool's
                continue
            held = self._held.get(request_id)
            if held is None:
                if not self._free:
                    continue
                held = self._held[request_id] = _Held(self._free.pop())
            held.full = after >= self.block_size
            if held.block == block:
                continue
            self._unmap(request_id, held, changes)
            previous = self._owner.get(block)
            if previous is not None:  # a shared block another request's slot served
                self._unmap(previous, self._held[previous], changes)
            held.block, self._owner[block] = block, request_id
            changes[block] = held.slot
            if before > 0:
                fills.append((block, held.slot, before))
        if changes:  # through pinned memory, without blocking the host (the step before may be running)
            device = self.slot_of.device
            blocks, slots = (
                to_device(list(changes), torch.int64, device),
                to_device(list(changes.values()), torch.int32, device),
            )
            self.slot_of.index_copy_(0, blocks, slots)
        for block, slot, rows in fills:
            self._fill(block, slot, rows)

    def _unmap(self, request_id: str, held: _Held, changes: dict[int, int] | None = None) -> None:
        """The request's slot stops serving its block (the slot stays the request's)."""
        if held.block is None:
            return
        if self._owner.get(held.block) == request_id:
            del self._owner[held.block]
            if changes is None:
                self.slot_of[held.block] = -1
            else:
                changes[held.block] = -1
        held.block, held.full = None, False

    def _fill(self, block: int, slot: int, rows: int) -> None:
        """Rows of `block` stored before it had its slot, copied in from the pool (dequantized)."""
        for pool, scale, layer in self._own.values():
            for side in (0, 1):
                stored = pool[side, block, :rows]  # [rows, H_kv, D]
                layer.cache[side, slot, :rows] = dequantize_kv(stored, scale[side, block, :, :rows].T).to(
                    layer.cache.dtype
                )
