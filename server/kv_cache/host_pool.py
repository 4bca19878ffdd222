"""Host memory for the host KV tier (`core/host_tier.py` decides what goes where).

One row of bytes a block: the block's slice of every block-indexed tensor of the pool (each layer's
keys and values, an 8-bit cache's scales, selective decode's key summaries), so that a block moves
between the device and host as one contiguous copy of ~1-2 MB at Llama-3-8B's shape, not as a
copy per layer. On CUDA the rows are pinned: offloads are gathered on the compute stream (behind
every step already queued there, so they copy what those steps wrote) and copied to host on a
side stream while the step computes; loads wait for that stream, copy to the device and scatter
into the pool ahead of the forward. Many blocks at once (a long context spilling, a long request
swapped out) copy in slices of STAGING_BYTES on the compute stream, reusing one slice of device
memory; so do all offloads where attention reads the rows in place, since the step's forward may
read them. The CPU backend runs the same code with plain copies, a second CPU pool standing in for
host memory.

The rows are one address range, so that `layer_views` can show a layer's blocks in them as a
strided tensor of the pool's own layout: what the long-context tier's attention reads in place
(on CUDA, kernels read pinned host memory over the link). Pinning tens of GiB takes seconds, so on
CUDA the range is registered with the driver in chunks of about 1 GiB by a background thread while
the engine starts and serves: `ready_blocks` says how many rows are pinned, the host tier uses only
those (`HostTier.grow`), and a copy that reaches past them (a shard whose pinning lags rank 0's)
waits for its chunk. The range is unregistered before it is freed: a range freed while still
registered cannot be registered again when the allocator hands the same addresses out anew.

What block selection reads of host blocks stays in device memory, written as blocks offload: their
key summaries (`keep_on_device`) and, in as many slots as were budgeted, copies of their keys in
e4m3 (`key_copies.HostKeyCopies`). The hot-block cache (`hot_blocks.HotBlockCache`), which holds
heads of host blocks that decode chose, forgets a block as it is offloaded into.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref

import torch

from tgserve.server.core.host_tier import KVTransfers
from tgserve.server.device.transfer import to_device
from tgserve.server.kv_cache.hot_blocks import HotBlockCache
from tgserve.server.kv_cache.key_copies import HostKeyCopies

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30  # host memory pinned at a time
STAGING_BYTES = 256 << 20  # device memory a step's copies go through at a time
PAGE_BYTES = 4096  # pinning works on whole pages: chunks start and end on page boundaries
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every device, readable by kernels.
REGISTER_FLAGS = 1 | 2


def _block_bytes_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each pool tensor [2, num_blocks, ...] as uint8 [2, num_blocks, bytes of one side of a block]."""
    views = []
    for tensor in tensors:
        assert tensor.is_contiguous() and tensor.shape[0] == 2
        views.append(tensor.view(torch.uint8).reshape(2, tensor.shape[1], -1))
    return views


def _chunk_blocks(block_bytes: int) -> int:
    """Rows pinned at a time: about CHUNK_BYTES, a whole number of pages (so chunks share none)."""
    pages_step = PAGE_BYTES // math.gcd(block_bytes, PAGE_BYTES)
    return max(1, CHUNK_BYTES // block_bytes // pages_step) * pages_step


class HostRows:
    """`num_blocks` rows of `block_bytes` in one range of host memory; on CUDA pinned (registered
    with the driver) a chunk at a time by a background thread, and unregistered by `close`."""

    def __init__(self, num_blocks: int, block_bytes: int, pin: bool) -> None:
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.chunk_blocks = _chunk_blocks(block_bytes) if pin else num_blocks
        # Committed by the OS only as pages are pinned or written; page-aligned for pinning.
        memory = torch.empty(num_blocks * block_bytes + PAGE_BYTES, dtype=torch.uint8)
        skip = -memory.data_ptr() % PAGE_BYTES
        self.rows = memory[skip : skip + num_blocks * block_bytes].view(num_blocks, block_bytes)
        self.ready = threading.Condition()
        self.ready_blocks = 0 if pin else num_blocks
        self.error: Exception | None = None
        self._registered: list[int] = []  # base addresses of the pinned chunks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if pin:
            self._thread = threading.Thread(target=self._pin, name="host-kv-pool", daemon=True)
            self._thread.start()

    def _pin(self) -> None:
        start, cudart = time.perf_counter(), torch.cuda.cudart()
        try:
            for first in range(0, self.num_blocks, self.chunk_blocks):
                if self._stop.is_set():
                    return
                count = min(self.chunk_blocks, self.num_blocks - first)
                address = self.rows[first].data_ptr()
                status = int(cudart.cudaHostRegister(address, count * self.block_bytes, REGISTER_FLAGS))
                if status != 0:
                    raise RuntimeError(
                        f"cudaHostRegister of {count * self.block_bytes} bytes failed: error {status}"
                    )
                self._registered.append(address)
                with self.ready:
                    self.ready_blocks = first + count
                    self.ready.notify_all()
        except Exception as error:  # the tier keeps the rows pinned so far; copies past them fail
            logger.error(
                "host KV tier: pinning its memory stopped at %d blocks: %s", self.ready_blocks, error
            )
            with self.ready:
                self.error = error
                self.ready.notify_all()
            return
        logger.info(
            "host KV tier: %d blocks of %.2f MiB (%.1f GiB, pinned) in %.1f s",
            self.num_blocks,
            self.block_bytes / 2**20,
            self.num_blocks * self.block_bytes / 2**30,
            time.perf_counter() - start,
        )

    def wait_for(self, needed: int) -> None:
        """Until the first `needed` rows are pinned; raises if pinning failed before them."""
        with self.ready:
            self.ready.wait_for(lambda: self.ready_blocks >= needed or self.error is not None)
            if self.ready_blocks < needed:
                raise RuntimeError(f"host KV tier: row {needed - 1} is not pinned ({self.error})")

    def close(self) -> None:
        """Stop pinning and unregister what was pinned (after every queued copy or kernel that may
        read it), before the memory is freed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._registered:
            torch.cuda.synchronize()
            cudart = torch.cuda.cudart()
            for address in self._registered:
                cudart.cudaHostUnregister(address)
            self._registered = []


class HostKVPool:
    """`num_blocks` host rows, each one block of the device pool's `tensors` (all of its layers)."""

    def __init__(self, tensors: list[torch.Tensor], num_blocks: int, device: torch.device) -> None:
        self.views = _block_bytes_views(tensors)
        self.block_bytes = sum(2 * view.shape[2] for view in self.views)
        self.device = device
        self.cuda = device.type == "cuda"
        self.num_blocks = num_blocks
        self._layouts = [(tensor.dtype, tuple(tensor.shape[2:])) for tensor in tensors]
        self._rows = HostRows(num_blocks, self.block_bytes, pin=self.cuda)
        weakref.finalize(self, self._rows.close)  # unpinned when collected: the rows hold no reference back
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # Set by `layer_views`: attention reads the rows in place, so a step's offloads (the
        # long-context tier's spills among them) land before its forward.
        self.read_in_place = False
        # (device tensor, its host blocks' copy in device memory): the key summaries attention
        # reads for host blocks, written as blocks are offloaded (`keep_on_device`).
        self._on_device: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.key_copies: HostKeyCopies | None = None  # device copies of offloaded blocks' keys
        self.hot_blocks: HotBlockCache | None = None  # host blocks' heads held on the device

    @property
    def ready_blocks(self) -> int:
        return self._rows.ready_blocks

    def wait_until_pinned(self) -> None:
        """Until every row is pinned (serving uses the rows as they come; a benchmark waits)."""
        self._rows.wait_for(self.num_blocks)

    def _row(self, block: int) -> torch.Tensor:
        return self._rows.rows[block]

    def layer_views(self) -> list[torch.Tensor]:
        """Each pool tensor's blocks as they lie in the host rows: dtype and shape of the tensor,
        [2, num_blocks, ...], strided (a block's row apart), aliasing the rows."""
        self.read_in_place = True
        rows, views, offset = self._rows.rows, [], 0
        for view, (dtype, shape) in zip(self.views, self._layouts, strict=True):
            side = view.shape[2]
            both = rows[:, offset : offset + 2 * side].view(self.num_blocks, 2, side).transpose(0, 1)
            views.append(both.view(dtype).unflatten(2, shape))
            offset += 2 * side
        return views

    def keep_on_device(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        key_copies: HostKeyCopies | None = None,
        hot_blocks: HotBlockCache | None = None,
    ) -> None:
        """For each (pool tensor [2, pool blocks, ...], device tensor [2, host blocks, ...]): every
        offloaded block's slice is copied into the second too, at its host block; and its keys into
        `key_copies`, where given; and `hot_blocks` forgets what it held of the block."""
        self._on_device = pairs
        self.key_copies = key_copies
        self.hot_blocks = hot_blocks

    def _wait_for(self, blocks: tuple[int, ...]) -> None:
        """Until the rows of `blocks` are pinned."""
        self._rows.wait_for(max(blocks) + 1)

    def apply(self, transfers: KVTransfers) -> None:
        """Run a step's copies: offloads first (their device blocks may be load targets), then loads.
        Many blocks at once (a long context spilling, a long request swapped) go through device
        memory a slice of STAGING_BYTES at a time."""
        step = max(1, STAGING_BYTES // self.block_bytes)
        if transfers.offloads:
            device_blocks, host_blocks = zip(*transfers.offloads, strict=True)
            self._wait_for(host_blocks)
            self._keep_on_device(device_blocks, host_blocks)
            # One slice copies beside the forward, on the side stream; more than one copy in turn
            # on the compute stream, each slice's staging memory reused by the next.
            side = self.cuda and len(device_blocks) <= step and not self.read_in_place
            for first in range(0, len(device_blocks), step):
                self._offload(device_blocks[first : first + step], host_blocks[first : first + step], side)
        if transfers.loads:
            host_blocks, device_blocks = zip(*transfers.loads, strict=True)
            self._wait_for(host_blocks)
            if self.cuda:  # offloads still copying may be writing the rows read here (earlier steps')
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            for first in range(0, len(host_blocks), step):
                self._load(host_blocks[first : first + step], device_blocks[first : first + step])

    def _keep_on_device(self, device_blocks: tuple[int, ...], host_blocks: tuple[int, ...]) -> None:
        if self._on_device or self.key_copies is not None or self.hot_blocks is not None:
            device_ids = to_device(device_blocks, torch.int64, self.device)
            host_ids = to_device(host_blocks, torch.int64, self.device)
            for pool_tensor, copy in self._on_device:
                copy.index_copy_(1, host_ids, pool_tensor.index_select(1, device_ids))
            if self.key_copies is not None:
                self.key_copies.copy(device_ids, host_ids)
            if self.hot_blocks is not None:
                self.hot_blocks.forget(host_ids)

    def _offload(self, device_blocks: tuple[int, ...], host_blocks: tuple[int, ...], side: bool) -> None:
        staging = self._gather(to_device(device_blocks, torch.int64, self.device))
        if not side:
            for i, row in enumerate(host_blocks):
                self._row(row).copy_(staging[i], non_blocking=self.cuda)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gather, and what it read
        with torch.cuda.stream(self.stream):
            for i, row in enumerate(host_blocks):
                self._row(row).copy_(staging[i], non_blocking=True)
        staging.record_stream(self.stream)  # not reused before the copies are done

    def _load(self, host_blocks: tuple[int, ...], device_blocks: tuple[int, ...]) -> None:
        if self.cuda:
            staging = torch.empty(len(host_blocks), self.block_bytes, dtype=torch.uint8, device=self.device)
            for i, row in enumerate(host_blocks):
                staging[i].copy_(self._row(row), non_blocking=True)
        else:
            staging = torch.stack([self._row(row) for row in host_blocks])
        self._scatter(staging, to_device(device_blocks, torch.int64, self.device))

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 [len(ids), block_bytes]: the blocks `ids` of every pool tensor, one row a block."""
        staging = torch.empty(ids.shape[0], self.block_bytes, dtype=torch.uint8, device=self.device)
        offset = 0
        for view in self.views:
            width = 2 * view.shape[2]
            part = staging[:, offset : offset + width].view(-1, 2, view.shape[2])
            part.copy_(view.index_select(1, ids).transpose(0, 1))
            offset += width
        return staging

    def _scatter(self, staging: torch.Tensor, ids: torch.Tensor) -> None:
        """Write each row of `staging` back as block ids[i] of every pool tensor."""
        offset = 0
        for view in self.views:
            width = 2 * view.shape[2]
            part = staging[:, offset : offset + width].view(-1, 2, view.shape[2])
            view.index_copy_(1, ids, part.transpose(0, 1))
            offset += width
