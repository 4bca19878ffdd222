"""The attention backend for a device: the one place that names the backends, each imported only
when chosen (so a CPU process never imports Triton, and none imports Habana's bridge)."""

from __future__ import annotations

import torch

from tgserve.kernels.decode_selection import DecodeSelection
from tgserve.kernels.sparse.config import SparseConfig
from tgserve.server.attention.backend import AttentionBackend


def attention_backend(
    device: torch.device, sparse: SparseConfig | None = None, selection: DecodeSelection | None = None
) -> AttentionBackend:
    """The backend for a device; each is imported only when chosen. `selection` (selective decode)
    is given to the backends that run it (cpu, cuda); on others the shard keeps decode dense."""
    if device.type == "cuda":
        from tgserve.kernels.triton_support import check_triton, installed_triton
        from tgserve.server.attention.cuda import CudaAttentionBackend

        check_triton(installed_triton())

        return CudaAttentionBackend(sparse, selection)
    if device.type == "cpu":
        from tgserve.server.attention.cpu import CpuAttentionBackend

        return CpuAttentionBackend(selection)
    if device.type == "hpu":
        from tgserve.server.attention.hpu import HpuAttentionBackend

        return HpuAttentionBackend()
    raise ValueError(f"no attention backend for device {device.type!r}; expected cuda, hpu or cpu")
