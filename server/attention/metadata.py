"""Per-step attention metadata: where each sequence's queries sit and where its KV lives."""

from __future__ import annotations

from dataclasses import dataclass

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


def shape_host_lists(num_tokens: int, num_seqs: int) -> tuple[list[int], list[int]]:
    """query_start_loc and seq_lens host lists that describe only the shape of a step: one query
    per sequence when there are as many tokens as sequences, else the first holds the extra ones."""
    lens = [1] * num_seqs if num_tokens == num_seqs else [num_tokens - num_seqs + 1, *[1] * (num_seqs - 1)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return starts, lens


def graph_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    context_bound: int | None = None,
) -> AttentionMetadata:
    """The metadata of a step recorded into a graph (CUDA graphs, HPU graphs): its device tensors
    are the graph's inputs, refilled at each replay, and its host lists describe only the step's
    shape (`shape_host_lists`), so that they hold at capture and at every replay alike."""
    starts, lens = shape_host_lists(slot_mapping.shape[0], seq_lens.shape[0])
    return AttentionMetadata(
        query_start_loc, seq_lens, block_tables, slot_mapping, starts, lens, block_size, context_bound
    )


def rows_as_sequences(metadata: AttentionMetadata, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables, seq_lens) that make each of `rows` a sequence of one query: its own sequence's
    blocks, and a context that ends at its position. Computed on the device, without a sync."""
    ends = metadata.query_start_loc[1:]
    seq = torch.searchsorted(ends, rows.to(ends.dtype), right=True)
    later_queries = ends[seq] - 1 - rows  # queries of its sequence after this row
    return metadata.block_tables[seq], (metadata.seq_lens[seq] - later_queries).to(torch.int32)
