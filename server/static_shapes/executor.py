"""Every step padded to its static shape and run as that shape: through its graph where steps are
graph-wrapped (HPU graphs), else the forward; and the warmup that runs every shape before serving."""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.execution.executor import Forward, StepExecutor
from tgserve.server.execution.step_inputs import StepInputs
from tgserve.server.static_shapes.buckets import StaticShapes, StepShape
from tgserve.server.static_shapes.graphs import StepGraphs
from tgserve.server.static_shapes.padding import ShapeLog, pad_step, shape_step, step_shape

logger = logging.getLogger(__name__)


class StaticShapeExecutor(StepExecutor):
    """Steps padded to `shapes`' buckets; `log` records each shape met (on Gaudi, each new one is a
    graph compile, so serving after `warm_up` should meet none)."""

    def __init__(self, shapes: StaticShapes, forward: Forward, step_graphs: StepGraphs | None = None) -> None:
        self.shapes, self.forward, self.step_graphs = shapes, forward, step_graphs
        self.log = ShapeLog()

    def run(self, inputs: StepInputs) -> torch.Tensor:
        shape = step_shape(self.shapes, inputs)
        self.log.record(shape)
        padded = pad_step(inputs, shape)
        return self.run_shape(
            shape, padded.input_ids, padded.positions, padded.metadata, padded.logits_indices
        )

    @torch.inference_mode()
    def run_shape(
        self,
        shape: StepShape,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """A step padded to `shape`: through its graph where steps are graph-wrapped, else the forward."""
        if self.step_graphs is not None:
            return self.step_graphs.run(shape, input_ids, positions, metadata, logits_indices)
        return self.forward(input_ids, positions, metadata, logits_indices)

    def warm_up(self, block_size: int, device: torch.device) -> None:
        """Run (so compile, and record as graphs where steps are graph-wrapped) every shape serving
        can meet, with a progress bar; logs the count and time."""
        todo = self.shapes.warmup_shapes()
        start = time.perf_counter()
        for shape in tqdm(todo, desc="warmup", unit="shape", disable=None):
            step = shape_step(shape, block_size, device)
            self.run_shape(shape, step.input_ids, step.positions, step.metadata, step.logits_indices)
            self.log.record(shape, warming_up=True)
        logger.info("warmup: %d step shapes in %.1f s", len(todo), time.perf_counter() - start)
