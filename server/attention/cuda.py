"""The cuda backend: the Triton kernels (and cuDNN / flash-attn for dense prompts) over the paged cache.

Each step takes one of three paths, decided once per step from host-side lengths:
- decode: every sequence has one query; the split-context paged decode kernel. This is the path
  CUDA graphs capture, so it reads only the metadata's device tensors and a fixed context bound.
- fresh prompts: no sequence has anything cached; the keys and values of this step are the whole
  context, so dense (or, above the threshold, sparse) causal attention runs on them directly.
- anything else (chunked prefill, prefix-cache hits, prefill beside decode): the varlen paged
  prefill kernel over every sequence's paged context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgserve.kernels import dispatch
from tgserve.kernels.sparse.config import SparseConfig
from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams
from tgserve.server.attention.metadata import AttentionMetadata, rows_as_sequences


@dataclass(frozen=True)
class CudaStepPlan:
    kind: str  # "decode", "fresh" or "paged"
    max_query_len: int
    max_seq_len: int  # host bound on seq_lens: sizes the decode kernel's context splits


def cuda_step_plan(metadata: AttentionMetadata) -> CudaStepPlan:
    cached = metadata.backend_cache.get("cuda")
    if cached is not None:
        return cached
    max_query_len = metadata.max_query_len
    if metadata.context_bound is not None:  # a captured graph: lengths change between replays
        max_seq_len = metadata.context_bound
    else:
        max_seq_len = metadata.max_seq_len
    if max_query_len == 1:
        kind = "decode"
    elif metadata.is_fresh:
        kind = "fresh"
    else:
        kind = "paged"
    plan = metadata.backend_cache["cuda"] = CudaStepPlan(kind, max_query_len, max_seq_len)
    return plan


class CudaAttentionBackend(AttentionBackend):
    """Paged attention with the Triton kernels; sparse prefill for prompts over the configured length."""

    name = "cuda"

    def __init__(self, sparse: SparseConfig | None = None) -> None:
        self.sparse = sparse

    @property
    def whole_prompt_tokens(self) -> int | None:
        return None if self.sparse is None else self.sparse.min_seq_len

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, layer: AttentionLayerParams):
        plan = cuda_step_plan(metadata)
        window = layer.spec.sliding_window
        if plan.kind == "fresh":
            dispatch.write_kv(key, value, kv_cache, metadata.slot_mapping)
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
        return dispatch.paged_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            layer.scale,
            window,
            layer.softcap,
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
            step_kv=(key, value, metadata.slot_mapping),
        )

    def forward_rows(self, query, key, value, kv_cache, metadata: AttentionMetadata, layer: AttentionLayerParams,
                     rows: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Stores every row's keys and values, then attends only the kept rows, each as a decode
        query over its own context: a 128K-token prompt's last layer skips its prompt attention
        (sparse or dense) and runs the split-context decode kernel on one row."""
        plan = cuda_step_plan(metadata)
        # A decode step's rows are each a sequence's only query: nothing to skip. A fresh step padded
        # to a static shape keeps one block-table column (its prompt attention reads none), so its
        # rows cannot be read back from the cache: they take the prompt attention of every row.
        if plan.kind == "decode" or not metadata.tables_cover_contexts:
            return super().forward_rows(query, key, value, kv_cache, metadata, layer, rows)
        dispatch.write_kv(key, value, kv_cache, metadata.slot_mapping)
        block_tables, seq_lens = rows_as_sequences(metadata, rows)
        kept = query[rows]
        starts = torch.arange(kept.shape[0] + 1, dtype=torch.int32, device=query.device)
        return dispatch.paged_attention(
            kept,
            kv_cache,
            block_tables,
            starts,
            seq_lens,
            layer.scale,
            layer.spec.sliding_window,
            layer.softcap,
            max_query_len=1,
            max_seq_len=plan.max_seq_len,
        )
