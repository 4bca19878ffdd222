"""How a step's forward runs on the device: the one owner of that choice.

The shard picks one executor when it allocates the KV pool and hands it to the runner: eager (this
module), decode steps replayed from CUDA graphs (`cuda_graphs.CudaGraphExecutor`), or every step
padded to a static shape (`static_shapes.executor.StaticShapeExecutor`). The runner builds a step's
inputs and samples from the logits; it never asks how they were computed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.execution.step_inputs import StepInputs

# (input_ids, positions, metadata, logits_indices) -> logits: `forward.ModelForward`.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


class StepExecutor(ABC):
    """Runs one step's forward."""

    @abstractmethod
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [>= len(inputs.logits_indices), vocab]: the rows of `inputs.logits_indices` in
        order, then any padding rows (dropped by the runner)."""


class EagerExecutor(StepExecutor):
    """The forward over the step as it is."""

    def __init__(self, forward: Forward) -> None:
        self.forward = forward

    def run(self, inputs: StepInputs) -> torch.Tensor:
        return self.forward(inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices)
