"""CUDA graphs of the decode step, one per padded batch size, replayed over persistent input buffers.

A decode step launches a few hundred small kernels whose launch cost, at small batches, exceeds
their run time; a graph replays them all at once. Inputs are copied into buffers the graph reads
(its addresses are fixed at capture); rows past the real batch are padding whose slot is -1 (their
keys and values are never written) and whose context is one token of a valid block, so they read
harmless data and their logits are dropped. The model and backend code are the same as eager.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from tgserve.server.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself), as vLLM pads."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode steps. `forward(input_ids, positions, metadata, logits_indices) -> logits`
    runs the model under the runner's forward context; it is called once per size to capture."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        context_bound: int,
        device: torch.device,
        sizes: list[int] | None = None,  # the batch sizes to capture (default: graph_batch_sizes)
    ) -> None:
        self.forward = forward
        self.sizes = sorted(sizes) if sizes else graph_batch_sizes(max_batch)
        self.block_size = block_size
        self.context_bound = context_bound
        self.device = device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
            block_size=self.block_size,
            context_bound=self.context_bound,
        )

    def _run(self, size: int) -> torch.Tensor:
        return self.forward(
            self.input_ids[:size], self.positions[:size], self._metadata(size), self.logits_indices[:size]
        )

    def capture(self) -> None:
        """Capture every size, largest first so that the smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._run(size)  # eager first: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._run(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode graphs in %.1f s", len(self.sizes), time.perf_counter() - start)

    def can_run(self, num_seqs: int, num_block_columns: int) -> bool:
        return (
            bool(self.graphs)
            and num_seqs <= self.max_batch
            and num_block_columns <= self.block_tables.shape[1]
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Copy one decode step's inputs in, replay the smallest graph that fits; [num_seqs, vocab] logits."""
        n, width = input_ids.shape[0], block_tables.shape[1]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return logits[:n]
