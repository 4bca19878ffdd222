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

import torch

from tgserve.server.attention.metadata import graph_metadata
from tgserve.server.execution.executor import Forward, StepExecutor
from tgserve.server.execution.step_inputs import StepInputs

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
        forward: Forward,
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

    def _run(self, size: int) -> torch.Tensor:
        metadata = graph_metadata(
            self.query_start_loc[: size + 1],
            self.seq_lens[:size],
            self.block_tables[:size],
            self.slot_mapping[:size],
            self.block_size,
            self.context_bound,
        )
        return self.forward(
            self.input_ids[:size], self.positions[:size], metadata, self.logits_indices[:size]
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


class CudaGraphExecutor(StepExecutor):
    """Pure decode steps that a captured graph covers replay it; every other step runs through
    `fallback` (eagerly, or padded to a static shape). With selective decode attention, a step
    whose contexts pass `long_context` tokens replays `long_graphs` (captured selecting), as they
    fit; the others would attend densely."""

    def __init__(
        self,
        graphs: DecodeGraphs,
        fallback: StepExecutor,
        long_graphs: DecodeGraphs | None = None,
        long_context: int | None = None,
    ) -> None:
        self.graphs, self.fallback = graphs, fallback
        self.long_graphs, self.long_context = long_graphs, long_context

    def run(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self._graphs_for(inputs)
        if graphs is None:
            return self.fallback.run(inputs)
        meta = inputs.metadata
        return graphs.run(
            inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens, meta.block_tables
        )

    def _graphs_for(self, inputs: StepInputs) -> DecodeGraphs | None:
        """The graphs that replay this step: one token per sequence, each sampled, no prompt
        scored, within the captured sizes (None: it runs through the fallback)."""
        meta = inputs.metadata
        num_seqs = meta.num_seqs
        if inputs.prompt_rows.spans or not inputs.input_ids.shape[0] == num_seqs == len(
            inputs.sampled_request_ids
        ):
            return None
        graphs = self.graphs
        if self.long_context is not None and meta.max_seq_len > self.long_context:
            graphs = self.long_graphs
        if graphs is None or not graphs.can_run(num_seqs, meta.block_tables.shape[1]):
            return None
        return graphs
