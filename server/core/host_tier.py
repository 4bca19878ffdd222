"""The host tier of the prefix cache: which full KV blocks host memory holds, by block hash.

Plain bookkeeping, as `block_manager` is; the bytes live in `kv_cache/host_pool.py`. A full block
evicted from the device's prefix cache is offered here: it takes a free host block, or the least
recently used one, and is written there before anything overwrites its device block (the step's
transfers run before its forward). A later request whose prefix continues into blocks held here
has them loaded into fresh device blocks instead of recomputed. The tier only ever holds copies:
a request never owns a host block, so a full tier evicts and never fails anything.

A step's transfers are collected here and handed to the runner with the step
(`take_transfers`): first every offload (device -> host), then every load (host -> device), then
the forward. A host block read by one of the step's loads is not given to an offload of the same
step (it would be overwritten before it is read).

A preempted request can also be swapped out here instead of recomputed later: its blocks are
held for it (`hold`: out of the cache, never evicted) until it is swapped back in or ends, and
given back at the end of that step (`release`), once its loads have read them.

The long-context tier holds blocks the same way for a running request whose context outgrows the
device pool: its cold blocks move here (`BlockManager.spill`) and attention reads them where they
lie, through block-table entries past the device pool's blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# The hash of a block is hash((parent_block_hash, tuple(token_ids))); the first block's parent is None.
BlockHash = int


@dataclass(frozen=True)
class KVTransfers:
    """One step's block copies, in the order they run: offloads, then loads, then the forward."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


@dataclass
class HostTierCounters:
    """Since start (or the last reset): blocks written to host, loaded back, and dropped from it."""

    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0
    swapped_out_requests: int = 0
    spilled_blocks: int = 0  # running requests' cold blocks moved to host (the long-context tier)


class HostTier:
    """Up to `num_blocks` host blocks holding evicted prefix blocks, least recently used first out.

    Only the first `ready` blocks are used: host memory may still be being allocated (pinning tens
    of GiB takes seconds), and `grow` adds blocks as it becomes ready.
    """

    def __init__(self, num_blocks: int, ready: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.capacity = num_blocks
        self.num_blocks = 0  # usable so far
        self._free: list[int] = []  # popped from the end: the lowest block first
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._hash_of: dict[int, BlockHash] = {}
        # This step's copies: offloads keyed by host block (a block given twice in one step keeps
        # only its last content), loads in order.
        self._offloads: dict[int, int] = {}
        self._loads: list[tuple[int, int]] = []
        self._reading: set[int] = set()  # host blocks this step's loads read
        self._released: list[int] = []  # held blocks given back at the end of the step
        self.num_held_blocks = 0
        self.counters = HostTierCounters()
        self.grow(num_blocks if ready is None else ready)

    def grow(self, ready: int) -> None:
        """Host blocks up to `ready` (at most the capacity) are allocated: use them."""
        ready = min(ready, self.capacity)
        if ready > self.num_blocks:
            self._free = list(range(ready - 1, self.num_blocks - 1, -1)) + self._free
            self.num_blocks = ready

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding cached prefixes or swapped-out requests."""
        return len(self._by_hash) + self.num_held_blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host block holding `block_hash`, or None."""
        return self._by_hash.get(block_hash)

    def offer(self, block_hash: BlockHash, device_block: int) -> None:
        """A full device block is being evicted: keep a copy of it (or refresh the one kept)."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return
        host_block = self._take_block()
        if host_block is None:
            return  # every host block is being read this step: this one is simply not kept
        self._by_hash[block_hash] = host_block
        self._hash_of[host_block] = block_hash
        self._offloads[host_block] = device_block
        self.counters.offloaded_blocks += 1

    def load(self, host_block: int, device_block: int) -> None:
        """Copy `host_block` into the fresh `device_block` this step (before the forward reads it)."""
        self._by_hash.move_to_end(self._hash_of[host_block])
        self._reading.add(host_block)
        self._loads.append((host_block, device_block))
        self.counters.loaded_blocks += 1

    def reserve(self, host_blocks: list[int]) -> None:
        """Keep these host blocks from this step's offloads: loads of them are about to be planned."""
        self._reading.update(host_blocks)

    @property
    def num_holdable_blocks(self) -> int:
        """Blocks `hold` can take this step: free ones and cached ones not being read."""
        return len(self._free) + sum(1 for b in self._by_hash.values() if b not in self._reading)

    def hold(self, device_blocks: list[int], swap: bool = True) -> list[int] | None:
        """Copy a preempted request's blocks (`swap`), or a running request's cold blocks (the
        long-context tier), to host blocks held for it (evicting cached ones as needed), or None,
        changing nothing, when the tier cannot give that many."""
        if len(device_blocks) > self.num_holdable_blocks:
            return None
        held = [self._take_block() for _ in device_blocks]
        for host_block, device_block in zip(held, device_blocks, strict=True):
            self._offloads[host_block] = device_block
        self.num_held_blocks += len(held)
        self.counters.offloaded_blocks += len(held)
        if swap:
            self.counters.swapped_out_requests += 1
        else:
            self.counters.spilled_blocks += len(held)
        return held

    def load_held(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy held blocks back into fresh device blocks this step, then give them back."""
        self._reading.update(host_blocks)
        self._loads.extend(zip(host_blocks, device_blocks, strict=True))
        self.counters.loaded_blocks += len(host_blocks)
        self.release(host_blocks)

    def release(self, host_blocks: list[int]) -> None:
        """Held blocks no longer needed (swapped in, or their request ended): free after this step."""
        self._released.extend(host_blocks)
        self.num_held_blocks -= len(host_blocks)

    def take_transfers(self) -> KVTransfers:
        """The step's copies, handed to the runner with the step; the next step starts empty."""
        transfers = KVTransfers([(d, h) for h, d in self._offloads.items()], self._loads)
        self._offloads, self._loads, self._reading = {}, [], set()
        self._free.extend(self._released)
        self._released = []
        return transfers

    def _take_block(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, host_block in self._by_hash.items():  # least recently used first
            if host_block not in self._reading:
                del self._by_hash[block_hash]
                del self._hash_of[host_block]
                self.counters.evicted_blocks += 1
                return host_block
        return None
