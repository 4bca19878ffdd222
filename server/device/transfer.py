"""Copies between host and device that do not make the host wait for the GPU.

A copy from pageable host memory waits for the work already queued on the stream; one from pinned
memory is queued behind it, so the host can prepare the next step while the GPU runs this one. The
same holds the other way: `.tolist()` on a device tensor waits for everything queued so far,
including a step launched after the one whose tokens it reads; `HostCopies` waits only for the work
queued before the copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Python values (a flat or nested list) as a tensor on `device`."""
    return pinned_to(torch.tensor(values, dtype=dtype), device)


def pinned_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; through pinned memory and without blocking when that is CUDA."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopies:
    """Device tensors copied to pinned host memory behind the work queued so far; `wait()` returns
    the host copies once that work (and nothing queued later) is done. Off CUDA: the tensors as they are."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self._host = list(tensors)
            return
        self._host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors
        ]
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
