"""Attention steps built by hand for backend tests: the metadata of a step over given block tables."""

from __future__ import annotations

import torch

from tgserve.server.attention.metadata import AttentionMetadata


def step_metadata(
    tables: list[list[int]], contexts: list[int], q_lens: list[int], slots: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """A step whose sequence i has context `contexts[i]` (this step's `q_lens[i]` rows last) over
    block table `tables[i]`, its rows stored at `slots`."""
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        torch.tensor(starts, dtype=torch.int32), torch.tensor(contexts, dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), slots,
        starts, list(contexts), block_size,
    )  # fmt: skip
