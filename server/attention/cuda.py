"""The cuda backend: the Triton kernels (and cuDNN / flash-attn for dense prompts) over the paged cache.

Each step takes one of three paths, decided once per step from host-side lengths:
- decode: every sequence has one query; the split-context paged decode kernel. This is the path
  CUDA graphs capture, so it reads only the metadata's device tensors and a fixed context bound.
- fresh prompts: no sequence has anything cached; the keys and values of this step are the whole
  context, so dense (or, above the threshold, sparse) causal attention runs on them directly (in
  the model's dtype: with an 8-bit cache, only later steps read the prompt's keys quantized).
- anything else (chunked prefill, prefix-cache hits, prefill beside decode): the varlen paged
  prefill kernel over every sequence's paged context.

With selective decode attention (`--decode-attention-budget`), a decode step whose contexts pass
the threshold first scores every block of each context by its key summary and chooses the blocks
to read (`dispatch.select_decode_blocks`), then runs the same decode kernel over them. Every path
folds the keys it stores into their blocks' summaries.

With the long-context tier (`--kv-offload-gb`), block-table entries past the pool's blocks name
blocks a request spilled to pinned host memory, and every kernel that reads the paged cache (decode,
paged prefill, block selection) reads them there, over the link, within the same launch: the host
never learns which blocks a step reads, so decode stays one captured graph. Selective decode keeps
the host blocks it chooses in the hot-block cache (`kv_cache/hot_blocks.py`), admitted on the device
after each layer's choice, and reads those it chose before from there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from tgserve.kernels import dispatch
from tgserve.kernels.decode_selection import DecodeSelection
from tgserve.kernels.sparse.config import SparseConfig
from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams, HostBlocks, StepPlan
from tgserve.server.attention.metadata import AttentionMetadata, rows_as_sequences
from tgserve.server.kv_cache.hot_blocks import admit_and_fill


class CudaPath(enum.Enum):
    """The kernel a step's attention takes, in every layer."""

    DECODE = "decode"  # the split-context paged decode kernel
    FRESH = "fresh"  # dense (library kernel) or sparse causal attention over the step's own keys
    PAGED = "paged"  # the varlen paged prefill kernel


@dataclass
class LongDecodes:
    """The decoding sequences of a mixed (paged) step that select: they attend through the decode
    kernel over their chosen blocks, as they would in a step of decode alone, so a request's
    tokens never depend on the prompts batched with it. The paged prefill kernel sees them with a
    context of one token (`prefill_seq_lens`), its output for their rows replaced."""

    rows: torch.Tensor  # int64 [n]: their query rows
    prefill_seq_lens: torch.Tensor  # int32 [num_seqs]: seq_lens, 1 at theirs
    # As decode sequences of their own, once a step for every layer: their block tables and
    # context lengths, and the tokens their chosen blocks hold (`DecodeSelection.lengths`).
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    lengths: torch.Tensor


def long_decodes(metadata: AttentionMetadata, selection: DecodeSelection) -> LongDecodes | None:
    starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    seqs = [i for i, n in enumerate(lens) if starts[i + 1] - starts[i] == 1 and n > selection.min_context]
    if not seqs:
        return None
    device = metadata.seq_lens.device
    index = torch.tensor(seqs, device=device)
    prefill_seq_lens = metadata.seq_lens.clone()
    prefill_seq_lens[index] = 1
    tables, seq_lens = metadata.block_tables[index], metadata.seq_lens[index]
    lengths = selection.lengths(seq_lens, metadata.block_size, tables.shape[1])
    rows = torch.tensor([starts[i] for i in seqs], device=device)
    return LongDecodes(rows, prefill_seq_lens, tables, seq_lens, lengths)


@dataclass
class CudaStepPlan(StepPlan):
    path: CudaPath = CudaPath.PAGED
    max_query_len: int = 0
    max_seq_len: int = 0  # host bound on seq_lens: sizes the decode kernel's context splits
    # Decode over the blocks that selection chooses (full-attention layers): the chosen blocks'
    # lengths per sequence, the same in every layer (`DecodeSelection.lengths`); None: dense.
    selected_lengths: torch.Tensor | None = None
    long_decodes: LongDecodes | None = None  # a paged step's decode rows that select


def cuda_step_plan(metadata: AttentionMetadata, selection: DecodeSelection | None = None) -> CudaStepPlan:
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
    selects = selection is not None and selection.selects(max_seq_len)
    lengths = None
    if path is CudaPath.DECODE and selects:
        lengths = selection.lengths(metadata.seq_lens, metadata.block_size, metadata.block_tables.shape[1])
        # What any sequence then reads: a context under the threshold, or the budget.
        max_seq_len = min(max_seq_len, max(selection.min_context, selection.budget))
    decodes = long_decodes(metadata, selection) if selects and path is CudaPath.PAGED else None
    return CudaStepPlan(metadata, path, max_query_len, max_seq_len, lengths, decodes)


def _host(host: HostBlocks | None) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    return None if host is None else host.blocks


def _selection_host(
    host: HostBlocks | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int, tuple | None] | None:
    return None if host is None else host.with_summaries


def _admit_hot_blocks(
    layer: AttentionLayerParams, chosen: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, kv_cache
) -> torch.Tensor | None:
    """Where the layer has a hot-block cache: the step's choice admitted into it, the new entries
    copied in; returns the map decode reads host blocks through (None without a cache)."""
    host = layer.host
    if host is None or host.hot is None:
        return None
    admit_and_fill(host.hot, chosen, tables, lengths, kv_cache, layer.kv_scale, host.cache, host.scale)
    return host.hot.map


class CudaAttentionBackend(AttentionBackend[CudaStepPlan]):
    """Paged attention with the Triton kernels; sparse prefill for prompts over the configured length."""

    name = "cuda"
    reads_scaled_kv = True
    reads_host_blocks = True

    def __init__(self, sparse: SparseConfig | None = None, selection: DecodeSelection | None = None) -> None:
        self.sparse = sparse
        self.selection = selection

    @property
    def whole_prompt_tokens(self) -> int | None:
        return None if self.sparse is None else self.sparse.min_seq_len

    def plan(self, metadata: AttentionMetadata) -> CudaStepPlan:
        return cuda_step_plan(metadata, self.selection)

    def _store(self, key, value, kv_cache, metadata: AttentionMetadata, layer: AttentionLayerParams) -> None:
        dispatch.write_kv(key, value, kv_cache, metadata.slot_mapping, layer.kv_scale, layer.tail_args)
        if layer.key_summary is not None:
            dispatch.update_key_summaries(key, metadata.slot_mapping, layer.key_summary, metadata.block_size)

    def forward(self, query, key, value, kv_cache, plan: CudaStepPlan, layer: AttentionLayerParams):
        metadata, window = plan.metadata, layer.spec.sliding_window
        if plan.path is CudaPath.DECODE:  # the kernel stores this step's keys and values itself
            selection, hot = None, None
            if plan.selected_lengths is not None and layer.key_summary is not None:
                chosen = dispatch.select_decode_blocks(query, layer.key_summary, metadata.block_tables,
                                                       metadata.seq_lens, self.selection, kv_cache, layer.kv_scale,
                                                       _selection_host(layer.host))  # fmt: skip
                selection = (chosen, plan.selected_lengths)
                hot = _admit_hot_blocks(layer, chosen, metadata.block_tables, plan.selected_lengths, kv_cache)
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
                selection=selection,
                key_summary=layer.key_summary,
                host=_host(layer.host),
                sinks=layer.sinks,
                hot=hot,
                tail=layer.tail_args,
            )
        self._store(key, value, kv_cache, metadata, layer)
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
                out=layer.out,
                sinks=layer.sinks,
            )
        decodes = plan.long_decodes if layer.key_summary is not None else None
        out = dispatch.paged_prefill(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens if decodes is None else decodes.prefill_seq_lens,
            layer.scale,
            window,
            layer.softcap,
            kv_scale=layer.kv_scale,
            host=_host(layer.host),
            sinks=layer.sinks,
            tail=layer.tail_args,
        )
        if decodes is not None:
            out[decodes.rows] = self._selective_decode(query[decodes.rows], kv_cache, layer, decodes)
        return out

    def _selective_decode(
        self, query, kv_cache, layer: AttentionLayerParams, decodes: LongDecodes
    ) -> torch.Tensor:
        """A mixed step's selecting decode queries (their keys already stored) over their chosen blocks."""
        tables, seq_lens = decodes.block_tables, decodes.seq_lens
        chosen = dispatch.select_decode_blocks(query, layer.key_summary, tables, seq_lens, self.selection, kv_cache,
                                               layer.kv_scale, _selection_host(layer.host))  # fmt: skip
        bound = max(self.selection.min_context, self.selection.budget)
        hot = _admit_hot_blocks(layer, chosen, tables, decodes.lengths, kv_cache)
        return dispatch.paged_decode(query, kv_cache, tables, seq_lens, layer.scale, None, layer.softcap,
                                     max_seq_len=bound, kv_scale=layer.kv_scale,
                                     selection=(chosen, decodes.lengths), host=_host(layer.host),
                                     sinks=layer.sinks, hot=hot, tail=layer.tail_args)  # fmt: skip

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
        self._store(key, value, kv_cache, metadata, layer)
        block_tables, seq_lens = rows_as_sequences(metadata, rows)
        decodes = plan.long_decodes if layer.key_summary is not None else None
        if decodes is not None:  # they select, as in every other layer: their dense read is one token
            # [kept, n]: where each selecting row is kept (every decode row is: its logits are read)
            at = rows[:, None] == decodes.rows[None, :]
            seq_lens = torch.where(at.any(1), 1, seq_lens).to(torch.int32)
        out = dispatch.paged_decode(
            query[rows],
            kv_cache,
            block_tables,
            seq_lens,
            layer.scale,
            layer.spec.sliding_window,
            layer.softcap,
            max_seq_len=plan.max_seq_len,
            kv_scale=layer.kv_scale,
            host=_host(layer.host),
            sinks=layer.sinks,
            tail=layer.tail_args,
        )
        if decodes is not None:
            out[at.int().argmax(0)] = self._selective_decode(query[decodes.rows], kv_cache, layer, decodes)
        return out
