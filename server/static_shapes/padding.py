"""Static-shape steps for graph-compiled devices: a step padded to its bucket, the log of the shapes
compiled, and the steps the warmup runs to compile every shape before serving.

On Gaudi every new input shape is a graph compile (seconds); serving must meet only shapes that
warmup compiled. The padding is device-agnostic and runs for real on CPU and CUDA in tests.
Padding never changes a real row:
- padding tokens belong to no sequence (they sit after the last sequence's queries), write no KV
  (slot -1), and every operation outside attention works row by row;
- padding sequences of a decode step hold one token with a context of one (block 0, read and
  never written); padding sequences of any other step hold no tokens;
- padding logits rows repeat row 0 and are dropped before sampling.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

import torch

from tgserve.server.attention.metadata import AttentionMetadata, shape_host_lists
from tgserve.server.device.transfer import to_device
from tgserve.server.execution.step_inputs import StepInputs, dummy_step
from tgserve.server.static_shapes.buckets import StaticShapes, StepShape


@dataclass
class ShapeLog:
    """The shapes (a `StepShape`, or any hashable key of a forward's input shapes) compiled so far:
    on Gaudi each new one is a graph compile; on CPU only the keys are kept, so that tests can check
    that serving after warmup compiles nothing new."""

    seen: set[Hashable] = field(default_factory=set)
    served: set[Hashable] = field(default_factory=set)  # shapes met while serving
    after_warmup: int = 0  # new shapes met while serving: compiles a user waits for

    def record(self, shape: Hashable, warming_up: bool = False) -> None:
        if not warming_up:
            self.served.add(shape)
        if shape not in self.seen:
            self.seen.add(shape)
            self.after_warmup += 0 if warming_up else 1

    @property
    def num_compiled(self) -> int:
        return len(self.seen)


def step_shape(shapes: StaticShapes, inputs: StepInputs) -> StepShape:
    meta = inputs.metadata
    return shapes.shape_for(
        inputs.input_ids.shape[0],
        meta.num_seqs,
        meta.block_tables.shape[1],
        inputs.logits_indices.shape[0],
        meta.is_fresh,
    )


def pad_rows(tensor: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """`tensor` with rows of `value` appended up to `length` rows."""
    extra = length - tensor.shape[0]
    return torch.cat([tensor, tensor.new_full((extra, *tensor.shape[1:]), value)]) if extra else tensor


def pad_metadata(meta: AttentionMetadata, shape: StepShape) -> AttentionMetadata:
    """The step's metadata with padding sequences (see the module docstring) and a wider block table."""
    extra = shape.num_seqs - meta.num_seqs
    last = meta.query_start_loc_cpu[-1]
    if shape.decode:
        starts = [*meta.query_start_loc_cpu, *range(last + 1, last + 1 + extra)]
        lens = [*meta.seq_lens_cpu, *[1] * extra]
    else:
        starts, lens = [*meta.query_start_loc_cpu, *[last] * extra], [*meta.seq_lens_cpu, *[0] * extra]
    device = meta.seq_lens.device
    tables = torch.zeros(shape.num_seqs, shape.num_blocks, dtype=meta.block_tables.dtype, device=device)
    width = min(shape.num_blocks, meta.block_tables.shape[1])  # a fresh step keeps its first column
    tables[: meta.num_seqs, :width] = meta.block_tables[:, :width]
    return replace(
        meta,
        query_start_loc=to_device(starts, meta.query_start_loc.dtype, device),
        seq_lens=to_device(lens, meta.seq_lens.dtype, device),
        block_tables=tables,
        slot_mapping=pad_rows(meta.slot_mapping, shape.num_tokens, -1),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )


def pad_step(inputs: StepInputs, shape: StepShape) -> StepInputs:
    """The step's inputs padded to `shape`; the real rows keep their places."""
    return replace(
        inputs,
        input_ids=pad_rows(inputs.input_ids, shape.num_tokens, 0),
        positions=pad_rows(inputs.positions, shape.num_tokens, 0),
        logits_indices=pad_rows(inputs.logits_indices, shape.num_logits, 0),
        metadata=pad_metadata(inputs.metadata, shape),
    )


def shape_step(shape: StepShape, block_size: int, device: torch.device) -> StepInputs:
    """A step of the given shape that writes nothing: a decode step of one-token contexts, or a
    prefill step whose first sequence holds every token but one per other sequence (at least two:
    a prefill shape has more tokens than sequences)."""
    _, lengths = shape_host_lists(shape.num_tokens, shape.num_seqs)
    return dummy_step(lengths, shape.num_blocks, block_size, device, logits_rows=[0] * shape.num_logits)
