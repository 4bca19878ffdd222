"""A step's device inputs as the runner builds them, and steps of a given shape that write nothing
(for profiling memory and for compiling static shapes before serving)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from tgserve.server.attention.metadata import AttentionMetadata


@dataclass
class PromptLogprobRows:
    """Which logits rows score which prompt tokens this step (rows after the sampled ones)."""

    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (request, first position, count)
    target_ids: list[int] = field(default_factory=list)
    top_n: list[int] = field(default_factory=list)


@dataclass
class StepInputs:
    """One step's flat batch on the device: what an executor runs the forward over."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    logits_indices: torch.Tensor  # int64 [num_logits]: the sampled rows first, then prompt-scored rows
    metadata: AttentionMetadata
    sampled_request_ids: list[str] = field(default_factory=list)
    prompt_rows: PromptLogprobRows = field(default_factory=PromptLogprobRows)
    # Decode rows whose input token a deferred step never sampled: computed, not sampled, deferred too.
    unknown_inputs: list[str] = field(default_factory=list)


def padded_block_table(rows: list[list[int]]) -> torch.Tensor:
    """int32 [len(rows), longest row], zero-padded; through numpy, 3x faster than nested lists."""
    lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))
    table = np.zeros((len(rows), int(lengths.max())), dtype=np.int32)
    table[np.arange(table.shape[1])[None, :] < lengths[:, None]] = flat
    return torch.from_numpy(table)


def dummy_step(
    lengths: list[int],
    num_block_columns: int,
    block_size: int,
    device: torch.device,
    logits_rows: list[int] | None = None,
) -> StepInputs:
    """Fresh prompts of `lengths` tokens that write nothing (slot -1), token id 0 throughout. Every
    block-table entry names block 0, so a backend that reads the cache during a prompt step (the
    last layer's kept rows on CUDA) stays inside even a one-block pool. logits_rows: the rows that
    reach the LM head (default: each prompt's last)."""
    starts = [0, *itertools.accumulate(lengths)]
    if logits_rows is None:
        logits_rows = [end - 1 for end in starts[1:]]
    num_tokens = starts[-1]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(lengths), num_block_columns, dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(lengths),
        block_size=block_size,
    )
    return StepInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(n) for n in lengths]).to(device),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        metadata=metadata,
    )
