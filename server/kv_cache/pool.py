"""The paged KV pool on the device: one tensor per layer, shaped by its `KVCacheSpec`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tgserve.server.kv_cache.spec import KVCacheSpec


def num_blocks_for_memory(specs: list[KVCacheSpec], block_size: int, memory_bytes: int) -> int:
    """How many blocks fit in `memory_bytes` across all layers (their summaries included)."""
    return max(1, memory_bytes // sum(spec.bytes_per_block(block_size) for spec in specs))


def _per_layer(specs: list[KVCacheSpec], make: Callable[[KVCacheSpec], Any]) -> list[Any]:
    """make(spec) for each layer; a layer that reads another's keys and values (`reads_kv_of`)
    gets that layer's tensor itself."""
    tensors: list[Any] = []
    for spec in specs:
        tensors.append(make(spec) if spec.reads_kv_of is None else tensors[spec.reads_kv_of])
    return tensors


def allocate_kv_caches(
    specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    return _per_layer(
        specs,
        lambda spec: torch.zeros(
            2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype, device=device
        ),
    )


def allocate_kv_scales(
    specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Per layer, an 8-bit cache's scales [2, num_blocks, num_kv_heads, block_size] float32 (zeros:
    a slot is read only after its row and scale are written), or None for a cache without."""
    return _per_layer(
        specs,
        lambda spec: (
            torch.zeros(2, num_blocks, spec.num_kv_heads, block_size, dtype=torch.float32, device=device)
            if spec.scaled
            else None
        ),
    )


def allocate_key_summaries(
    specs: list[KVCacheSpec], num_blocks: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Per layer, its blocks' key summaries [2, num_blocks, num_kv_heads, head_dim] (selective
    decode; a block's are set when its first slot is written), or None for a layer without."""
    return _per_layer(
        specs,
        lambda spec: (
            None
            if spec.summary_dtype is None
            else torch.zeros(
                2, num_blocks, spec.num_kv_heads, spec.head_dim, dtype=spec.summary_dtype, device=device
            )
        ),
    )


def scratch_slot(kv_cache: torch.Tensor) -> int:
    """The first slot of the pool's last block: where a backend whose writes cannot skip slot -1
    (HPU's static-shape `index_copy_`) sends padding rows. That block must be one the block manager
    never hands out: the pool is allocated `AttentionBackend.scratch_blocks` larger than its count."""
    return (kv_cache.shape[1] - 1) * kv_cache.shape[2]
