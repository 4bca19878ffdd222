"""The interface every attention backend (cpu, cuda, hpu) implements.

A step reaches a backend twice: `plan(metadata)` once, before the first layer, where the backend
makes every choice the step's shape and lengths decide (which kernel, which index tensors) into a
typed `StepPlan` of its own; then `forward` in every layer, with that plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn

from tgserve.kernels.decode_selection import DecodeSelection
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.kv_cache.hot_blocks import HotLayer
from tgserve.server.kv_cache.key_copies import LayerKeyCopy
from tgserve.server.kv_cache.spec import KVCacheSpec
from tgserve.server.kv_cache.tail_blocks import LayerTail


@dataclass(frozen=True)
class HostBlocks:
    """A layer's blocks in the host tier (`HostKVPool.layer_views`), read where they lie by a
    backend that `reads_host_blocks`: block ids from `first` (the pool's block count) on name host
    block id - first (the long-context tier, `BlockManager.spill`)."""

    first: int
    cache: torch.Tensor  # [2, host_blocks, block_size, num_kv_heads, head_dim], strided by block
    scale: torch.Tensor | None = None  # an 8-bit cache's scales, [2, host_blocks, num_kv_heads, block_size]
    summary: torch.Tensor | None = None  # key summaries, [2, host_blocks, num_kv_heads, head_dim]
    key_copy: LayerKeyCopy | None = None  # device copies of some host blocks' keys (rescoring reads them)
    hot: HotLayer | None = None  # chosen host blocks kept in device blocks, per KV head (decode reads them)

    @property
    def blocks(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """As the paged kernels read them (`dispatch.paged_decode`'s and `paged_prefill`'s `host`)."""
        return self.cache, self.scale, self.first

    @property
    def with_summaries(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int, tuple | None]:
        """As block selection reads them (`dispatch.select_decode_blocks`'s `host`)."""
        assert self.summary is not None, "selection reads the host blocks' key summaries"
        copy = self.key_copy
        copies = None if copy is None else (copy.keys, copy.scales, copy.slot_of)
        return self.cache, self.scale, self.summary, self.first, copies


@dataclass
class AttentionLayerParams:
    """What a layer tells the backend beyond its tensors."""

    spec: KVCacheSpec
    scale: float
    softcap: float | None = None
    layer_idx: int = 0  # per-layer settings (sparse patterns) are keyed by it
    # An 8-bit cache's scales, [2, num_blocks, num_kv_heads, block_size] float32 (kv_cache/spec.py):
    # the backend writes and reads the layer's cache through them. None for a cache in the model's dtype.
    kv_scale: torch.Tensor | None = None
    # The layer's key summary per block, [2, num_blocks, num_kv_heads, head_dim]: the backend folds
    # the keys it stores into it, and decode may select blocks by it. None: no selection (a sliding
    # window layer, or selection off).
    key_summary: torch.Tensor | None = None
    # Where the backend may write this call's output [num_tokens, num_heads, head_dim] instead of
    # allocating it (a whole long prompt's attention writes over the layer's normed input, dead by
    # then: 8 GiB at a million tokens of Llama-3-8B). A backend that cannot returns a new tensor.
    out: torch.Tensor | None = None
    host: HostBlocks | None = None  # the layer's blocks in the host tier, where requests spill there
    # Learned attention sinks (gpt-oss's `sinks`), float32 [num_heads]: each head's logit of a key
    # with a zero value in every row's softmax, taking a share of the attention. The CPU and CUDA
    # backends compute them; the model loader refuses such models on a Gaudi.
    sinks: torch.Tensor | None = None
    # An 8-bit cache's full-precision tail (server/kv_cache/tail_blocks.py): rows written into a
    # block with a slot go there too, and each sequence's current block is read from its slot.
    tail: LayerTail | None = None

    @property
    def tail_args(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tail slots, block -> slot map), as the kernels take them, or None."""
        return None if self.tail is None else self.tail.as_kernel_args


@dataclass
class StepPlan:
    """What every layer of one step shares: the step's metadata and, in each backend's subclass,
    the choices made from it once."""

    metadata: AttentionMetadata


Plan = TypeVar("Plan", bound=StepPlan)


class AttentionBackend(ABC, Generic[Plan]):
    """Writes a step's keys and values into the paged cache, then attends over each sequence's context."""

    name: str
    # Blocks this backend needs past the block manager's (at the end of the pool): a scratch block
    # takes the writes of padding rows when the backend cannot skip slot -1 (see kv_cache.pool.scratch_slot).
    scratch_blocks: int = 0
    # True when the work of a step depends only on its shape and the metadata's device tensors (not
    # its host lists): then a padded step can be replayed from a graph recorded for its shape.
    shape_only: bool = False
    # True when the backend writes and reads an 8-bit (fp8, int8) KV cache (AttentionLayerParams.kv_scale).
    reads_scaled_kv: bool = False
    # True when the backend reads blocks spilled to the host tier where they lie
    # (AttentionLayerParams.host): requests whose context outgrows the pool may then spill.
    reads_host_blocks: bool = False
    # Selective decode attention (kernels/decode_selection.py), given to the backends that run it
    # (cpu and cuda; the shard keeps decode dense on the others).
    selection: DecodeSelection | None = None

    @property
    def whole_prompt_tokens(self) -> int | None:
        """Prompts at least this long are worth prefilling whole, in a step of their own (sparse
        attention needs every key of the prompt in the step); None: chunks are as good."""
        return None

    def graph_wrap(self, module: nn.Module) -> nn.Module:
        """The module replayed as a graph per input shape, where the device records graphs that way
        (HPU graphs); the module itself elsewhere."""
        return module

    def mark_step(self) -> None:
        """The end of a part of the step (the forward, the sampling). Lazy-mode devices (Gaudi) run
        the operations queued so far as one graph here; others do nothing."""
        return

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> Plan:
        """The step's plan, built once before its first layer. Inside a captured graph (CUDA or HPU)
        it is built at capture, from the captured step: it may depend on the step's shape and on
        `metadata.context_bound`, and must compute any per-step values as device tensors."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: Plan,
        layer: AttentionLayerParams,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention output for every query row of the flat batch."""

    def forward_rows(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: Plan,
        layer: AttentionLayerParams,
        rows: torch.Tensor,  # int64 [num_kept]: rows of the flat batch
    ) -> torch.Tensor:  # [num_kept, num_heads, head_dim]
        """Attention output of the query rows `rows` only, every row's keys and values stored all
        the same (a model's last layer, where only the rows a logit reads go on). By default every
        row is attended and the kept ones are taken."""
        return self.forward(query, key, value, kv_cache, plan, layer)[rows]
