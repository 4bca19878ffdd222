"""The per-step context through which model layers reach the backend, the metadata and their KV views.

Models never take backend arguments in their forward signature (that is how model files get forked
per backend); the runner sets this context once per step and attention layers read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams, HostBlocks, StepPlan
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.kv_cache.spec import KVCacheSpec
from tgserve.server.kv_cache.tail_blocks import LayerTail


@dataclass
class ForwardContext:
    """One forward pass: the backend and the plan it made for the step, the per-layer KV views
    (with an 8-bit cache, each layer's scales beside them, and where decode attention selects blocks,
    each layer's key summaries; empty otherwise)."""

    backend: AttentionBackend
    plan: StepPlan
    kv_caches: list[torch.Tensor]
    specs: list[KVCacheSpec]
    kv_scales: list[torch.Tensor | None] = field(default_factory=list)
    key_summaries: list[torch.Tensor | None] = field(default_factory=list)  # selective decode's, per layer
    host_blocks: list[HostBlocks | None] = field(default_factory=list)  # the long-context tier's, per layer
    tails: list[LayerTail | None] = field(default_factory=list)  # an 8-bit cache's tail slots, per layer

    def kv_scale(self, layer_idx: int) -> torch.Tensor | None:
        return self.kv_scales[layer_idx] if self.kv_scales else None

    def key_summary(self, layer_idx: int) -> torch.Tensor | None:
        return self.key_summaries[layer_idx] if self.key_summaries else None

    def host(self, layer_idx: int) -> HostBlocks | None:
        return self.host_blocks[layer_idx] if self.host_blocks else None

    def tail(self, layer_idx: int) -> LayerTail | None:
        return self.tails[layer_idx] if self.tails else None

    @property
    def metadata(self) -> AttentionMetadata:
        return self.plan.metadata


_current: ForwardContext | None = None


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    """Make `context` the current one for the duration of a forward pass."""
    global _current
    previous, _current = _current, context
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention was called outside a forward pass set up by the model runner")
    return _current


def paged_attention(
    layer_idx: int,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for layer `layer_idx` of the current step, reading and writing its KV view; with
    `rows`, the output of those query rows only (every row's keys and values are stored); `out`, a
    buffer the backend may write the output into (`AttentionLayerParams.out`); `sinks`, learned
    per-head sink logits (`AttentionLayerParams.sinks`)."""
    ctx = get_forward_context()
    layer = AttentionLayerParams(ctx.specs[layer_idx], scale, softcap, layer_idx, ctx.kv_scale(layer_idx),
                                 ctx.key_summary(layer_idx), out, ctx.host(layer_idx), sinks,
                                 ctx.tail(layer_idx))  # fmt: skip
    cache = ctx.kv_caches[layer_idx]
    if rows is None:
        return ctx.backend.forward(query, key, value, cache, ctx.plan, layer)
    return ctx.backend.forward_rows(query, key, value, cache, ctx.plan, layer, rows)
