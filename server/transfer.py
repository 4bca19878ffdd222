"""Host-to-device copies that do not make the host wait for the GPU.

A copy from pageable host memory waits for the work already queued on the stream; one from pinned
memory is queued behind it, so the host can prepare the next step while the GPU runs this one.
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
