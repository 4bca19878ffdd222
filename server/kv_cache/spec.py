"""KV cache specs derived per architecture from the HF config, and the paged pool built from them.

Model code never sees a cache format: the engine allocates one tensor per layer,
[2, num_blocks, block_size, num_kv_heads, head_dim] (keys then values), all layers sharing the same
block ids, and each attention layer reads and writes its own slice through the forward context.
A backend that cannot skip a write (slot -1) asks for scratch blocks at the end of the pool, beyond
the blocks the block manager hands out (`AttentionBackend.scratch_blocks`, `scratch_slot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tgserve.server.distributed.tensor_parallel import split_evenly


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention layer's cache: how many KV heads (1 for multi-query), their size, and its window.

    sliding_window=None is full attention; w means a query at position p sees keys in (p - w, p].
    """

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else "sliding_window"

    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def _first_attr(config: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def num_layers(config: Any) -> int:
    return int(_first_attr(config, ("num_hidden_layers", "n_layer", "num_layers")))


def num_attention_heads(config: Any) -> int:
    return int(_first_attr(config, ("num_attention_heads", "n_head")))


def num_kv_heads(config: Any) -> int:
    """KV heads, covering GQA (num_key_value_heads), multi-query flags and Falcon's two layouts."""
    heads = num_attention_heads(config)
    if getattr(config, "model_type", "") == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return int(config.num_kv_heads)
        return 1 if getattr(config, "multi_query", False) else heads
    if getattr(config, "multi_query", False):
        return 1
    return int(_first_attr(config, ("num_key_value_heads", "num_kv_heads"), heads))


def head_dim(config: Any) -> int:
    explicit = getattr(config, "head_dim", None)
    if explicit:
        return int(explicit)
    hidden = int(_first_attr(config, ("hidden_size", "n_embd", "d_model")))
    return hidden // num_attention_heads(config)


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per layer: the sliding window or None. `layer_types` wins; else a global window if enabled."""
    n = num_layers(config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types[:n]]
    if window is not None and getattr(config, "use_sliding_window", True):
        return [int(window)] * n
    return [None] * n


def kv_cache_specs(config: Any, dtype: torch.dtype, tensor_parallel_size: int = 1) -> list[KVCacheSpec]:
    """The cache every layer of this architecture needs, read off its HF config; with tensor
    parallelism, one shard's (its share of the KV heads)."""
    local = split_evenly(num_kv_heads(config), tensor_parallel_size, "KV heads")
    dim = head_dim(config)
    return [KVCacheSpec(local, dim, dtype, window) for window in layer_sliding_windows(config)]


def kv_bytes_per_token(specs: list[KVCacheSpec]) -> int:
    """The keys and values one token holds across all layers."""
    return sum(spec.bytes_per_token() for spec in specs)
