"""Host memory for the host tier of the prefix cache (`core/host_tier.py` decides what goes where).

One row of bytes a block: the block's slice of every block-indexed tensor of the pool (each layer's
keys and values, an fp8 cache's scales, selective decode's key summaries), so that a block moves
between the device and host as one contiguous copy of ~1-2 MB at Llama-3-8B's shape, not as a
copy per layer. On CUDA the rows are pinned: offloads are gathered on the compute stream (behind
every step already queued there, so they copy what those steps wrote) and copied to host on a
side stream while the step computes; loads wait for that stream, copy to the device and scatter
into the pool ahead of the forward. The CPU backend runs the same code with plain copies, a second
CPU pool standing in for host memory.

Pinning tens of GiB takes seconds, so on CUDA the rows are allocated in chunks of about 1 GiB by a
background thread while the engine starts and serves: `ready_blocks` says how many exist, the host
tier uses only those (`HostTier.grow`), and a copy that reaches past them (a shard whose allocation
lags rank 0's) waits for its chunk. On the CPU the rows are one range, and `layer_views` reads a
layer's blocks in it as a strided tensor of the pool's own layout: what the long-context tier's
attention reads in place.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from tgserve.server.core.host_tier import KVTransfers
from tgserve.server.device.transfer import to_device

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30  # host memory allocated (and pinned) at a time


def _block_bytes_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each pool tensor [2, num_blocks, ...] as uint8 [2, num_blocks, bytes of one side of a block]."""
    views = []
    for tensor in tensors:
        assert tensor.is_contiguous() and tensor.shape[0] == 2
        views.append(tensor.view(torch.uint8).reshape(2, tensor.shape[1], -1))
    return views


class HostKVPool:
    """`num_blocks` host rows, each one block of the device pool's `tensors` (all of its layers)."""

    def __init__(self, tensors: list[torch.Tensor], num_blocks: int, device: torch.device) -> None:
        self.views = _block_bytes_views(tensors)
        self.block_bytes = sum(2 * view.shape[2] for view in self.views)
        self.device = device
        self.cuda = device.type == "cuda"
        self.num_blocks = num_blocks
        self.chunk_blocks = max(1, CHUNK_BYTES // self.block_bytes)
        self._layouts = [(tensor.dtype, tuple(tensor.shape[2:])) for tensor in tensors]
        self._chunks: list[torch.Tensor] = []
        self._ready = threading.Condition()
        self.ready_blocks = 0
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:
            threading.Thread(target=self._allocate, name="host-kv-pool", daemon=True).start()
        else:  # one range: what `layer_views` needs (committed by the OS only as rows are written)
            self.chunk_blocks = max(1, num_blocks)
            self._allocate()

    def _allocate(self) -> None:
        start = time.perf_counter()
        for first in range(0, self.num_blocks, self.chunk_blocks):
            count = min(self.chunk_blocks, self.num_blocks - first)
            chunk = torch.empty(count, self.block_bytes, dtype=torch.uint8, pin_memory=self.cuda)
            with self._ready:
                self._chunks.append(chunk)
                self.ready_blocks = first + count
                self._ready.notify_all()
        logger.info(
            "host KV tier: %d blocks of %.2f MiB (%.1f GiB%s) in %.1f s",
            self.num_blocks,
            self.block_bytes / 2**20,
            self.num_blocks * self.block_bytes / 2**30,
            ", pinned" if self.cuda else "",
            time.perf_counter() - start,
        )

    def _row(self, block: int) -> torch.Tensor:
        return self._chunks[block // self.chunk_blocks][block % self.chunk_blocks]

    def layer_views(self) -> list[torch.Tensor]:
        """Each pool tensor's blocks as they lie in the host rows: dtype and shape of the tensor,
        [2, num_blocks, ...], strided (a block's row apart), aliasing the rows. The rows must be one
        range: on the CPU they are; on CUDA they are pinned chunk by chunk (one range registered
        with the driver in chunks is the next step, with its unregistering)."""
        if len(self._chunks) != 1:
            raise NotImplementedError("layer views need the host rows in one range (the CPU backend's)")
        rows, views, offset = self._chunks[0], [], 0
        for view, (dtype, shape) in zip(self.views, self._layouts, strict=True):
            side = view.shape[2]
            both = rows[:, offset : offset + 2 * side].view(self.num_blocks, 2, side).transpose(0, 1)
            views.append(both.view(dtype).unflatten(2, shape))
            offset += 2 * side
        return views

    def _wait_for(self, blocks: tuple[int, ...]) -> None:
        """Until the chunks holding `blocks` are allocated."""
        needed = max(blocks) + 1
        with self._ready:
            self._ready.wait_for(lambda: self.ready_blocks >= needed)

    def apply(self, transfers: KVTransfers) -> None:
        """Run a step's copies: offloads first (their device blocks may be load targets), then loads."""
        if transfers.offloads:
            self._offload(*zip(*transfers.offloads, strict=True))
        if transfers.loads:
            self._load(*zip(*transfers.loads, strict=True))

    def _offload(self, device_blocks: tuple[int, ...], host_blocks: tuple[int, ...]) -> None:
        self._wait_for(host_blocks)
        staging = self._gather(to_device(device_blocks, torch.int64, self.device))
        if not self.cuda:
            for i, row in enumerate(host_blocks):
                self._row(row).copy_(staging[i])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gather, and what it read
        with torch.cuda.stream(self.stream):
            for i, row in enumerate(host_blocks):
                self._row(row).copy_(staging[i], non_blocking=True)
        staging.record_stream(self.stream)  # not reused before the copies are done

    def _load(self, host_blocks: tuple[int, ...], device_blocks: tuple[int, ...]) -> None:
        self._wait_for(host_blocks)
        if self.cuda:
            # Offloads still copying may be writing the rows read here (from earlier steps).
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
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
