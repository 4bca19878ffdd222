"""KV cache specs derived per architecture from the HF config, and the paged pool built from them.

Model code never sees a cache format: the engine allocates one tensor per layer,
[2, num_blocks, block_size, num_kv_heads, head_dim] (keys then values), all layers sharing the same
block ids, and each attention layer reads and writes its own slice through the forward context.
A backend that cannot skip a write (slot -1) asks for scratch blocks at the end of the pool, beyond
the blocks the block manager hands out (`AttentionBackend.scratch_blocks`, `scratch_slot`).

An 8-bit cache (`--kv-cache-dtype fp8`: e4m3 values; `int8`: integers) stores, beside its values,
one float32 scale per (token, KV head) row, set when the row is written: [2, num_blocks,
num_kv_heads, block_size] (`kernels/kv_format.quantize_kv`). A scale per row needs no calibration
and never saturates; it costs 4 bytes a head_dim-long row (3% at 128). A KV head's scales of a
block are contiguous, so a kernel reading a tile of one head's keys loads their scales as one run,
not one 4-byte word per 32-byte sector.

Where decode attention selects blocks (`--decode-attention-budget`), each full-attention layer also
keeps a key summary per block: the channel-wise minimum and maximum of its keys, in the model's
dtype, [2, num_blocks, num_kv_heads, head_dim] (`kernels/decode_selection.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import INT8, SCALED_KV_DTYPES
from tgserve.server.distributed.tensor_parallel import split_evenly

# --kv-cache-dtype: vLLM's names, TGI's fp8_e4m3fn, and int8. "auto" keeps the model's dtype; fp8 is
# e4m3 (OCP's fn variant). The router's flag lists the same names (router/serve_args.py).
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8, "fp8_e4m3fn": FP8, "int8": INT8}


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention layer's cache: how many KV heads (1 for multi-query), their size, and its window.

    sliding_window=None is full attention; w means a query at position p sees keys in (p - w, p].
    """

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the cache stores: the model's dtype, e4m3 or int8
    sliding_window: int | None = None
    summary_dtype: torch.dtype | None = None  # the blocks' key summaries (selective decode), or none
    # KV sharing (Gemma 3n, Gemma 4's small models): a layer that attends over an earlier layer's keys
    # and values, which it is handed and stores again unchanged; its cache is that layer's tensors.
    reads_kv_of: int | None = None

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else "sliding_window"

    @property
    def scaled(self) -> bool:
        """An 8-bit cache (e4m3 or int8): each (token, KV head) row has a float32 scale beside it."""
        return self.dtype in SCALED_KV_DTYPES

    def bytes_per_token(self) -> int:
        """Keys and values (and an 8-bit cache's scales); the block's summary is `summary_bytes`.
        Nothing for a layer that reads another's (`reads_kv_of`)."""
        if self.reads_kv_of is not None:
            return 0
        row = self.head_dim * self.dtype.itemsize + (4 if self.scaled else 0)
        return 2 * self.num_kv_heads * row

    def summary_bytes(self) -> int:
        """A block's key summary: minimum and maximum per KV head and channel."""
        if self.summary_dtype is None or self.reads_kv_of is not None:
            return 0
        return 2 * self.num_kv_heads * self.head_dim * self.summary_dtype.itemsize

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token() + self.summary_bytes()


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


def is_latent_attention(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): keys and values are decompressed from a
    latent for every attention head, keys of qk_nope + qk_rope dims, values of v_head_dim. The cache
    holds them decompressed (every head's), values padded to the keys' width where narrower."""
    return (
        getattr(config, "kv_lora_rank", None) is not None
        and getattr(config, "qk_nope_head_dim", None) is not None
    )


def num_kv_heads(config: Any) -> int:
    """KV heads, covering GQA (num_key_value_heads), multi-query flags and Falcon's two layouts."""
    heads = num_attention_heads(config)
    if is_latent_attention(config):
        return heads
    if getattr(config, "model_type", "") == "jetmoe":  # its KV heads repeated for each of top_k experts
        return int(config.num_key_value_heads) * int(config.num_experts_per_tok)
    if getattr(config, "model_type", "") == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return int(config.num_kv_heads)
        return 1 if getattr(config, "multi_query", False) else heads
    if getattr(config, "multi_query", False):
        return 1
    return int(_first_attr(config, ("num_key_value_heads", "num_kv_heads"), heads))


def head_dim(config: Any) -> int:
    if is_latent_attention(config):
        return max(int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim), int(config.v_head_dim))
    if getattr(config, "model_type", "") == "jetmoe":
        return int(config.kv_channels)
    explicit = getattr(config, "head_dim", None)
    if explicit:
        return int(explicit)
    hidden = int(_first_attr(config, ("hidden_size", "n_embd", "d_model")))
    return hidden // num_attention_heads(config)


# Model types whose config carries a `sliding_window` that transformers' model never applies (Moshi
# masks with `create_causal_mask` only): full attention, as they run there (docs/architectures.md).
WINDOW_NOT_APPLIED = frozenset({"moshi"})


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per layer: the sliding window or None. `layer_types` wins; else a global window if enabled."""
    n = num_layers(config)
    if getattr(config, "model_type", None) in WINDOW_NOT_APPLIED:
        return [None] * n
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types[:n]]
    if window is not None and getattr(config, "use_sliding_window", True):
        return [int(window)] * n
    return [None] * n


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """What the cache stores for --kv-cache-dtype `name`: the model's dtype for "auto"."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def layer_configs(config: Any) -> list[Any]:
    """Per layer, the config its attention is built from: transformers 5's heterogeneous configs
    (Gemma 4: wider heads, other KV head counts, on its full-attention layers) have one of their
    own, on which the global config's values that vary raise; every other config is the same
    throughout."""
    n = num_layers(config)
    if getattr(config, "is_heterogeneous", False):
        return [config.per_layer_config[i] for i in range(n)]
    return [config] * n


# Models whose layers of a kind have more KV heads than the config says, by a rule in their code:
# MiMo-V2-Flash's sliding-window layers have twice `num_key_value_heads` (found by the sweep).
KV_HEADS_FACTOR_BY_LAYER_TYPE = {"mimo_v2_flash": {"sliding_attention": 2}}


def layer_kv_heads(config: Any) -> list[int]:
    """Per layer, its KV heads: each layer's config's, times a model's own factor for its kind."""
    factors = KV_HEADS_FACTOR_BY_LAYER_TYPE.get(getattr(config, "model_type", None), {})
    kinds = getattr(config, "layer_types", None) or [None] * num_layers(config)
    return [num_kv_heads(layer) * factors.get(kind, 1) for layer, kind in zip(layer_configs(config), kinds)]


def kv_cache_specs(config: Any, dtype: torch.dtype, tensor_parallel_size: int = 1) -> list[KVCacheSpec]:
    """The cache every layer of this architecture needs, read off its HF config (each layer's own,
    `layer_configs`), storing `dtype` (`kv_cache_dtype`); with tensor parallelism, one shard's
    (its share of the KV heads). Layers that reuse an earlier layer's keys and values read its cache."""
    per_layer = zip(layer_configs(config), layer_kv_heads(config), layer_sliding_windows(config),
                    kv_sharing_sources(config), strict=True)  # fmt: skip
    return [
        KVCacheSpec(
            split_evenly(heads, tensor_parallel_size, "KV heads"),
            head_dim(layer),
            dtype,
            window,
            reads_kv_of=source,
        )
        for layer, heads, window, source in per_layer
    ]


def kv_sharing_sources(config: Any) -> list[int | None]:
    """Per layer, the earlier layer whose keys and values it attends over, or None. transformers 5
    names the sharing (`kv_sharing_modes`: "reuse" layers take the keys and values of the last
    "store" layer of their type, handed to their attention as they are): such layers store the
    same rows again, so their cache can be the source's. Configs without it (transformers 4's Gemma
    3n computes the shared layers' keys itself) keep a cache a layer."""
    try:
        modes = getattr(config, "kv_sharing_modes", None)
    except (ValueError, RuntimeError):  # an inconsistent sharing (no layer to share from): none
        modes = None
    n = num_layers(config)
    if not isinstance(modes, list | tuple) or "reuse" not in modes:
        return [None] * n
    kinds = config.layer_types
    stores = {kinds[i]: i for i in range(n) if modes[i] == "store"}
    return [stores[kinds[i]] if modes[i] == "reuse" else None for i in range(n)]


def with_key_summaries(specs: list[KVCacheSpec], dtype: torch.dtype) -> list[KVCacheSpec]:
    """The specs with a key summary per block in `dtype` for every full-attention layer (sliding
    window layers attend over their window only: nothing to select)."""
    return [replace(spec, summary_dtype=dtype) if spec.sliding_window is None else spec for spec in specs]


def kv_bytes_per_token(specs: list[KVCacheSpec], block_size: int) -> int:
    """What one token holds across all layers: keys and values, scales, and its share of its
    block's summaries (at blocks of `block_size`)."""
    return -(-sum(spec.bytes_per_block(block_size) for spec in specs) // block_size)
