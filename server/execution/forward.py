"""The model's forward over one step, with its attention backend, the step's plan and the KV views
set as the forward context: what every executor runs, and what the memory profile measures."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from tgserve.server.attention.backend import AttentionBackend, HostBlocks
from tgserve.server.attention.forward_context import ForwardContext, forward_context
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.kv_cache.hot_blocks import HotBlockCache
from tgserve.server.kv_cache.key_copies import HostKeyCopies
from tgserve.server.kv_cache.pool import allocate_key_summaries, allocate_kv_caches, allocate_kv_scales
from tgserve.server.kv_cache.spec import KVCacheSpec
from tgserve.server.kv_cache.tail_blocks import LayerTail, TailBlocks


class ModelForward:
    """`forward(input_ids [T], positions [T], metadata, logits_indices [N]) -> logits [N, vocab]`.

    The backend plans the step once, before the first layer; the layers reach that plan, the
    backend and their KV views through the forward context. The shard sets the pool
    (`allocate_pool`): a one-block placeholder while the pool is sized, then the pool.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, specs: list[KVCacheSpec]) -> None:
        self.model = model
        self.backend = backend
        self.specs = specs
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: list[torch.Tensor | None] = []  # an 8-bit cache's scales, per layer
        self.key_summaries: list[torch.Tensor | None] = []  # blocks' key summaries (selective decode)
        self.host_blocks: list[HostBlocks | None] = []  # per layer, where requests spill to host
        self.tails: TailBlocks | None = None  # an 8-bit cache's full-precision tail slots
        self.tail_layers: list[LayerTail | None] = []  # per layer, None where the cache is not 8-bit

    def allocate_pool(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        """Every layer's KV cache of `num_blocks` blocks (and, for an 8-bit cache, its scales; where
        decode attention selects blocks, their key summaries)."""
        self.release_pool()
        self.kv_caches = allocate_kv_caches(self.specs, num_blocks, block_size, device)
        self.kv_scales = allocate_kv_scales(self.specs, num_blocks, block_size, device)
        self.key_summaries = allocate_key_summaries(self.specs, num_blocks, device)

    def attach_tails(self, slots: int, dtype: torch.dtype) -> TailBlocks | None:
        """An 8-bit cache's tail (`TailBlocks`): `slots` blocks in `dtype` in every 8-bit layer,
        each running request's current block kept there too. None where no layer is 8-bit."""
        scaled = [(cache, scale) for cache, scale in zip(self.kv_caches, self.kv_scales, strict=True)
                  if scale is not None]  # fmt: skip
        if not scaled or slots <= 0:
            return None
        self.tails = TailBlocks(scaled, slots, dtype)
        layers = iter(self.tails.layers)
        self.tail_layers = [None if scale is None else next(layers) for scale in self.kv_scales]
        return self.tails

    def attach_host_tier(
        self, views: list[torch.Tensor], first: int, key_copy_slots: int = 0, hot_slots: int = 0
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], HostKeyCopies | None, HotBlockCache | None]:
        """The host tier's rows as every layer's pool tensors (`HostKVPool.layer_views`, in
        `block_tensors` order), whose block ids start at `first`: attention reads spilled blocks
        through them. The host blocks' key summaries are read from device memory instead (block
        selection scores every block of a context each step: over the link that would be ~1 GB a
        token at a million tokens of Llama-3-8B); returns them as (device summaries, host blocks'
        summaries) per layer, for the host pool to keep up to date, and, given `key_copy_slots`,
        device copies of as many host blocks' keys (`HostKeyCopies`: what selection rescores
        candidates from), for the host pool to fill; given `hot_slots`, the hot-block cache in the
        pool's last `hot_slots` blocks before `first` (`HotBlockCache`: chosen host blocks that
        decode then reads on the device), for the host pool to keep true."""
        rest, mirrors, self.host_blocks, selecting = iter(views), [], [], []
        for spec, (device_cache, scale, summary) in zip(self.specs, self._per_layer(), strict=True):
            if spec.reads_kv_of is not None:  # another layer's tensors: its host blocks too (below)
                self.host_blocks.append(None)
                continue
            cache, host_scale = next(rest), None if scale is None else next(rest)
            host_summary = None
            if summary is not None:
                next(rest)  # the rows' copy of the summaries: what a block loaded back carries
                host_summary = summary.new_zeros((2, cache.shape[1], *summary.shape[2:]))
                mirrors.append((summary, host_summary))
                selecting.append((len(self.host_blocks), device_cache, scale))
            self.host_blocks.append(HostBlocks(first, cache, host_scale, host_summary))
        copies, hot = self._host_block_copies(selecting, first, key_copy_slots, hot_slots)
        for layer, spec in enumerate(self.specs):
            if spec.reads_kv_of is not None:
                self.host_blocks[layer] = self.host_blocks[spec.reads_kv_of]
        return mirrors, copies, hot

    def _host_block_copies(
        self, selecting: list[tuple[int, torch.Tensor, torch.Tensor | None]], first: int, key_copy_slots: int,
        hot_slots: int,
    ) -> tuple[HostKeyCopies | None, HotBlockCache | None]:  # fmt: skip
        """The selecting layers' key copies and hot-block cache (see `attach_host_tier`)."""
        if not selecting:
            return None, None
        host_blocks = self.host_blocks[selecting[0][0]].cache.shape[1]
        copies, hot = None, None
        if key_copy_slots:
            copies = HostKeyCopies(
                [(cache, scale) for _, cache, scale in selecting], key_copy_slots, host_blocks
            )
            for (layer, _, _), copy in zip(selecting, copies.layers, strict=True):
                self.host_blocks[layer] = replace(self.host_blocks[layer], key_copy=copy)
        if hot_slots:
            num_kv_heads = max(cache.shape[3] for _, cache, _ in selecting)
            hot = HotBlockCache(
                len(selecting),
                num_kv_heads,
                hot_slots,
                first - hot_slots,
                host_blocks,
                selecting[0][1].device,
            )
            for (layer, _, _), hot_layer in zip(selecting, hot.layers, strict=True):
                self.host_blocks[layer] = replace(self.host_blocks[layer], hot=hot_layer)
        return copies, hot

    def _per_layer(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Each layer's (cache, fp8 scales or None, key summaries or None)."""
        none = [None] * len(self.kv_caches)
        return zip(self.kv_caches, self.kv_scales or none, self.key_summaries or none, strict=True)

    def block_tensors(self) -> list[torch.Tensor]:
        """Every pool tensor indexed by block at dimension 1 ([2, num_blocks, ...]): what one block
        of the pool is, layer by layer (its keys and values, scales, key summaries); a layer that
        reads another's keys and values has none of its own."""
        return [
            t
            for spec, tensors in zip(self.specs, self._per_layer(), strict=True)
            if spec.reads_kv_of is None
            for t in tensors
            if t is not None
        ]

    def release_pool(self) -> None:
        self.kv_caches, self.kv_scales, self.key_summaries, self.host_blocks = [], [], [], []
        self.tails, self.tail_layers = None, []

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        context = ForwardContext(self.backend, self.backend.plan(metadata), self.kv_caches, self.specs,
                                 self.kv_scales, self.key_summaries, self.host_blocks, self.tail_layers)  # fmt: skip
        with forward_context(context):
            return self.model(input_ids, positions, logits_indices)
