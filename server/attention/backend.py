"""The interface every attention backend (cpu, cuda, hpu) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class AttentionLayerParams:
    """What a layer tells the backend beyond its tensors."""

    spec: KVCacheSpec
    scale: float
    softcap: float | None = None


class AttentionBackend(ABC):
    """Writes a step's keys and values into the paged cache, then attends over each sequence's context."""

    name: str

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        layer: AttentionLayerParams,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention output for every query row of the flat batch."""
