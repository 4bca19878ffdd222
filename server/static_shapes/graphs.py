"""A padded step's forward as a module of tensors only, for graph wrappers keyed on input shapes.

Habana's `wrap_in_hpu_graph` records a module's device work once per set of input shapes and
replays it with each call's tensors. The attention metadata normally reaches the layers through the
forward context, outside the module's inputs, where a replay would keep the recorded step's values;
here every per-step tensor is an input and the metadata is rebuilt from them inside the module. The
host lists of that metadata are derived from the shapes alone (`attention.metadata.graph_metadata`),
so only backends whose work depends on the step's shape and device tensors
(`AttentionBackend.shape_only`) can run this way.
"""

from __future__ import annotations

import torch
from torch import nn

from tgserve.server.attention.metadata import AttentionMetadata, graph_metadata
from tgserve.server.execution.executor import Forward
from tgserve.server.static_shapes.buckets import StepShape


class StepModule(nn.Module):
    """`forward(input_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping,
    logits_indices) -> logits` over the runner's model; nothing per step lives outside the inputs."""

    def __init__(self, forward: Forward, block_size: int) -> None:
        super().__init__()
        self._step_forward = forward
        self.block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        metadata = graph_metadata(query_start_loc, seq_lens, block_tables, slot_mapping, self.block_size)
        return self._step_forward(input_ids, positions, metadata, logits_indices)


class StepGraphs:
    """Padded steps run through a `StepModule`: the graph-wrapped one (HPU graphs) for the shapes
    graphs are on for, a plain one for the others (LIMIT_HPU_GRAPH keeps prefill out of graphs)."""

    def __init__(self, graphed: nn.Module, plain: nn.Module, decode_only: bool) -> None:
        self.graphed, self.plain, self.decode_only = graphed, plain, decode_only

    def run(
        self,
        shape: StepShape,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        module = self.graphed if shape.decode or not self.decode_only else self.plain
        return module(
            input_ids,
            positions,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.slot_mapping,
            logits_indices,
        )
