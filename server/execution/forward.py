"""The model's forward over one step, with its attention backend, the step's plan and the KV views
set as the forward context: what every executor runs, and what the memory profile measures."""

from __future__ import annotations

import torch
from torch import nn

from tgserve.server.attention.backend import AttentionBackend
from tgserve.server.attention.forward_context import ForwardContext, forward_context
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.kv_cache.spec import KVCacheSpec


class ModelForward:
    """`forward(input_ids [T], positions [T], metadata, logits_indices [N]) -> logits [N, vocab]`.

    The backend plans the step once, before the first layer; the layers reach that plan, the
    backend and their KV views through the forward context. `kv_caches` is set by the shard: a
    one-block placeholder while the pool is sized, then the pool.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, specs: list[KVCacheSpec]) -> None:
        self.model = model
        self.backend = backend
        self.specs = specs
        self.kv_caches: list[torch.Tensor] = []

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        context = ForwardContext(self.backend, self.backend.plan(metadata), self.kv_caches, self.specs)
        with forward_context(context):
            return self.model(input_ids, positions, logits_indices)
