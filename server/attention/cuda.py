"""The cuda backend: the Triton kernels (and cuDNN / flash-attn for dense prompts) over the paged cache.

Each step takes one of three paths, decided once per step from host-side lengths:
- decode: every sequence has one query; the split-context paged decode kernel. This is the path
  CUDA graphs capture, so it reads only the metadata's device tensors and a fixed context bound.
- fresh prompts: no sequence has anything cached; the keys and values of this step are the whole
  context, so dense (or, above the threshold, sparse) causal attention runs on them directly (in
  the model's dtype: with an fp8 cache, only later steps read the prompt's keys quantized).
- anything else (chunked prefill, prefix-cache hits, prefill beside decode): the varlen paged
  prefill kernel over every sequence's paged context.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from tgserve.kernels import dispatch
from tgserve.kernels.sparse.config import SparseConfig
from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams, StepPlan
from tgserve.server.attention.metadata import AttentionMetadata, rows_as_sequences


class CudaPath(enum.Enum):
    """The kernel a step's attention takes, in every layer."""

    DECODE = "decode"  # the split-context paged decode kernel
    FRESH = "fresh"  # dense (library kernel) or sparse causal attention over the step's own keys
    PAGED = "paged"  # the varlen paged prefill kernel


@dataclass
class CudaStepPlan(StepPlan):
    path: CudaPath = CudaPath.PAGED
    max_query_len: int = 0
    max_seq_len: int = 0  # host bound on seq_lens: sizes the decode kernel's context splits


def cuda_step_plan(metadata: AttentionMetadata) -> CudaStepPlan:
    """The step's path, from host-side lengths; under a captured graph (context_bound set) the
    context length is the bound, which holds for every replay."""
    max_query_len = metadata.max_query_len
    if metadata.context_bound is not None:
        max_seq_len = metadata.context_bound
    else:
        max_seq_len = metadata.max_seq_len
    if max_query_len == 1:  # the decode kernel takes no rows beyond the sequences' (padding rows)
        path = CudaPath.DECODE if metadata.slot_mapping.shape[0] == metadata.num_seqs else CudaPath.PAGED
    elif metadata.is_fresh:
        path = CudaPath.FRESH
    else:
        path = CudaPath.PAGED
    return CudaStepPlan(metadata, path, max_query_len, max_seq_len)


class CudaAttentionBackend(AttentionBackend[CudaStepPlan]):
    """Paged attention with the Triton kernels; sparse prefill for prompts over the configured length."""

    name = "cuda"
    reads_fp8_kv = True

    def __init__(self, sparse: SparseConfig | None = None) -> None:
        self.sparse = sparse

    @property
    def whole_prompt_tokens(self) -> int | None:
        return None if self.sparse is None else self.sparse.min_seq_len

    def plan(self, metadata: AttentionMetadata) -> CudaStepPlan:
        return cuda_step_plan(metadata)

    def forward(self, query, key, value, kv_cache, plan: CudaStepPlan, layer: AttentionLayerParams):
        metadata, window = plan.metadata, layer.spec.sliding_window
        if plan.path is CudaPath.DECODE:  # the kernel stores this step's keys and values itself
            return dispatch.paged_decode(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                layer.scale,
                window,
                layer.softcap,
                max_seq_len=plan.max_seq_len,
                step_kv=(key, value, metadata.slot_mapping),
                kv_scale=layer.kv_scale,
            )
        dispatch.write_kv(key, value, kv_cache, metadata.slot_mapping, layer.kv_scale)
        if plan.path is CudaPath.FRESH:
            return dispatch.fresh_prefill(
                query,
                key,
                value,
                metadata.query_start_loc,
                metadata.query_start_loc_cpu,
                layer.scale,
                window,
                layer.softcap,
                self.sparse,
                layer.layer_idx,
            )
        return dispatch.paged_prefill(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            layer.scale,
            window,
            layer.softcap,
            kv_scale=layer.kv_scale,
        )

    def forward_rows(self, query, key, value, kv_cache, plan: CudaStepPlan, layer: AttentionLayerParams,
                     rows: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Stores every row's keys and values, then attends only the kept rows, each as a decode
        query over its own context: a 128K-token prompt's last layer skips its prompt attention
        (sparse or dense) and runs the split-context decode kernel on one row."""
        metadata = plan.metadata
        # One query per sequence: each row is its sequence's only query, nothing to skip. A fresh
        # step padded to a static shape keeps one block-table column (its prompt attention reads
        # none), so its rows cannot be read back from the cache: they take every row's attention.
        if plan.max_query_len == 1 or not metadata.tables_cover_contexts:
            return super().forward_rows(query, key, value, kv_cache, plan, layer, rows)
        dispatch.write_kv(key, value, kv_cache, metadata.slot_mapping, layer.kv_scale)
        block_tables, seq_lens = rows_as_sequences(metadata, rows)
        return dispatch.paged_decode(
            query[rows],
            kv_cache,
            block_tables,
            seq_lens,
            layer.scale,
            layer.spec.sliding_window,
            layer.softcap,
            max_seq_len=plan.max_seq_len,
            kv_scale=layer.kv_scale,
        )
