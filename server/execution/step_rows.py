"""A step's per-token input columns (token ids, positions, cache slots), built on the host.

Decode rows arrive one token at a time and stay Python ints; a prompt span becomes tensors in a few
vector ops. Built token by token in Python, a 128K-token prompt's columns took ~35 ms of host time
before its first kernel (slots alone: one division and lookup per token), on the time to its
first token.
"""

from __future__ import annotations

import torch

from tgserve.server.device.transfer import pinned_to


class HostRows:
    """One int64 column of a step: runs of Python ints and tensor spans, joined once, in order."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._run: list[int] = []
        self._joined = 0  # rows already in _parts

    def __len__(self) -> int:
        return self._joined + len(self._run)

    def append(self, value: int) -> None:
        self._run.append(value)

    def extend_tensor(self, values: torch.Tensor) -> None:
        self._close_run()
        self._parts.append(values)
        self._joined += values.numel()

    def to(self, device: torch.device) -> torch.Tensor:
        """The whole column on `device` (through pinned memory on CUDA)."""
        self._close_run()
        if not self._parts:
            return pinned_to(torch.empty(0, dtype=torch.int64), device)
        return pinned_to(self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts), device)

    def _close_run(self) -> None:
        if self._run:
            self._parts.append(torch.tensor(self._run, dtype=torch.int64))
            self._joined += len(self._run)
            self._run = []


def span_slots(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """int64 cache slots of positions start .. end - 1 of a sequence, page by page."""
    first = start // block_size
    pages = torch.tensor(block_ids[first : (end - 1) // block_size + 1], dtype=torch.int64)
    slots = (pages[:, None] * block_size + torch.arange(block_size)).flatten()
    offset = start - first * block_size
    return slots[offset : offset + end - start]
