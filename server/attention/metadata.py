"""Per-step attention metadata: where each sequence's queries sit and where its KV lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Flat variable-length batch description, built once per step by the model runner.

    Queries of sequence i are rows query_start_loc[i]:query_start_loc[i+1] of the flat batch, and
    are the last q_len positions of a context of seq_lens[i] tokens (this step's included).
    slot_mapping[t] = block_id * block_size + offset for token t (-1: do not write).
    The *_cpu lists carry the same numbers on the host, for loops that must not synchronise.
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Set when the step runs in a captured graph: an upper bound on seq_lens that holds for every
    # replay (the host lists describe only the step it was captured with).
    context_bound: int | None = None
    # Whatever a backend derives from this metadata once per step and reuses in every layer.
    backend_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        starts = self.query_start_loc_cpu
        return max((b - a for a, b in zip(starts, starts[1:])), default=0)

    @property
    def is_fresh(self) -> bool:
        """No sequence has context before this step: each one's context is exactly its queries."""
        starts = self.query_start_loc_cpu
        return all(n == b - a for n, a, b in zip(self.seq_lens_cpu, starts, starts[1:]))

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def tables_cover_contexts(self) -> bool:
        """Every sequence's block table names a block for each position of its context (a fresh
        step padded to a static shape keeps only one column: nothing in its prompt attention reads it)."""
        return self.block_tables.shape[1] * self.block_size >= self.max_seq_len


def rows_as_sequences(metadata: AttentionMetadata, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables, seq_lens) that make each of `rows` a sequence of one query: its own sequence's
    blocks, and a context that ends at its position. Computed on the device, without a sync."""
    ends = metadata.query_start_loc[1:]
    seq = torch.searchsorted(ends, rows.to(ends.dtype), right=True)
    later_queries = ends[seq] - 1 - rows  # queries of its sequence after this row
    return metadata.block_tables[seq], (metadata.seq_lens[seq] - later_queries).to(torch.int32)
