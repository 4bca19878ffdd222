"""The hpu backend: attention over the paged cache in static shapes, FusedSDPA for prefill steps.

A Gaudi compiles one graph per input shape, and an HPU graph replays what it recorded: so `forward`
has no host synchronisation and no Python control flow on tensor values. Its choices depend only on
the step's shape (`HpuStepPlan.shape_key`: decode or not, tokens, sequences, block-table columns),
which is what the static-shape runner buckets and warms up; every per-step number (lengths, starts,
slots, blocks) is read from the metadata's device tensors.

- decode (one query per sequence): each sequence's whole block-table row gathered, one masked
  attention over [num_seqs, columns * block_size] keys, in plain torch.
- any other step (fresh prompts, chunks after cached context, prefix hits, decodes among them): one
  FusedSDPA call over the flat step. Its keys are every sequence's cached context, gathered through
  the block table, followed by the step's own keys; the mask keeps each query to its own sequence,
  to positions before this step in the cached part and to causal order in the step's part. One
  call per step shape rather than one per sequence (a graph per mix of lengths); a fresh prompt and
  a chunk after a prefix run the same graph. When the runner narrows the block table to the cached
  context (one column for fresh prompts, all masked), the cached part costs little; a lone fresh prompt is
  plain causal and needs no mask at all.

Keys and values are written with `index_copy_` along the flattened slots. It cannot skip slot -1,
so padding rows write to the scratch slot (`kv_cache.pool.scratch_slot`, in the pool's last block, which
the block manager never hands out: the pool is `scratch_blocks` larger than its count).

Padding (as `tgserve.server.static_shapes.padding` pads): rows past query_start_loc[-1] belong to no sequence
and attend only to one another; padding sequences hold one token of a one-token context (decode) or
none. Padding rows' outputs are unspecified but finite: every row may attend to itself at least.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams, StepPlan
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.device.habana import GaudiOps, HabanaOps
from tgserve.server.kv_cache.pool import scratch_slot


@dataclass
class HpuStepPlan(StepPlan):
    """What every layer of one step shares: the step's shape and, built by the first layer that
    needs each, its index tensors and masks (per sliding window; biases per window and dtype)."""

    decode: bool = False  # one query per sequence, no row left over
    num_tokens: int = 0
    num_seqs: int = 0
    num_columns: int = 0  # block-table columns
    slots: torch.Tensor | None = None
    block_ids: torch.Tensor | None = None
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    prefill_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    prefill_biases: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)

    @property
    def shape_key(self) -> tuple[bool, int, int, int]:
        """What one compiled graph of this backend is specific to."""
        return (self.decode, self.num_tokens, self.num_seqs, self.num_columns)


def hpu_step_plan(metadata: AttentionMetadata) -> HpuStepPlan:
    """The step's plan: its shape, from which every choice of this backend follows."""
    num_tokens, num_seqs = metadata.slot_mapping.shape[0], metadata.num_seqs
    decode = num_tokens == num_seqs and metadata.max_query_len == 1
    return HpuStepPlan(metadata, decode, num_tokens, num_seqs, metadata.block_tables.shape[1])


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: HpuStepPlan) -> None:
    """Every row's key and value into its slot, padding rows (slot -1) into the scratch slot."""
    if plan.slots is None:
        slot_mapping = plan.metadata.slot_mapping
        plan.slots = torch.where(slot_mapping >= 0, slot_mapping, scratch_slot(kv_cache))
    slots = plan.slots
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))


def gather_blocks(
    kv_cache: torch.Tensor, plan: HpuStepPlan
) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_seqs, columns * block_size, num_kv_heads, head_dim]
    """Every sequence's whole block-table row, as rows of a 2D view (one row memcpy per block)."""
    block_tables = plan.metadata.block_tables
    if plan.block_ids is None:
        plan.block_ids = block_tables.reshape(-1).long()
    block_ids = plan.block_ids
    shape = (block_tables.shape[0], -1, *kv_cache.shape[-2:])
    num_blocks = kv_cache.shape[1]
    return tuple(kv_cache[i].view(num_blocks, -1).index_select(0, block_ids).view(shape) for i in (0, 1))


def decode_mask(plan: HpuStepPlan, window: int | None) -> torch.Tensor:
    """[num_seqs, 1, columns * block_size]: positions up to the query's (seq_len - 1), in the window."""
    mask, metadata = plan.decode_masks.get(window), plan.metadata
    if mask is None:
        query_pos = metadata.seq_lens.long()[:, None, None] - 1
        key_pos = torch.arange(plan.num_columns * metadata.block_size, device=query_pos.device)
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        plan.decode_masks[window] = mask
    return mask


def prefill_mask(plan: HpuStepPlan, window: int | None) -> torch.Tensor:
    """[num_tokens, num_seqs * columns * block_size + num_tokens]: which cached keys (gathered rows
    of every sequence) and which of this step's keys each query of the flat step may attend."""
    mask, metadata = plan.prefill_masks.get(window), plan.metadata
    if mask is not None:
        return mask
    start = metadata.query_start_loc.long()
    context = metadata.seq_lens.long() - (start[1:] - start[:-1])  # cached before this step
    token = torch.arange(plan.num_tokens, device=start.device)
    seq = (token[:, None] >= start[None, 1:]).sum(-1)  # num_seqs for rows past the last sequence
    own = seq.clamp(max=plan.num_seqs - 1)
    query_pos = context[own] + token - start[own]
    # This step's keys: its own sequence, causal; within a sequence, row distance is position distance.
    step = (seq[:, None] == seq[None, :]) & (token[None, :] <= token[:, None])
    if window is not None:
        step &= token[:, None] - token[None, :] < window
    width = plan.num_columns * metadata.block_size
    key_seq = torch.arange(plan.num_seqs, device=start.device).repeat_interleave(width)
    key_pos = torch.arange(width, device=start.device).repeat(plan.num_seqs)
    cached = (key_seq[None, :] == seq[:, None]) & (key_pos[None, :] < context[own][:, None])
    if window is not None:
        cached &= key_pos[None, :] > query_pos[:, None] - window
    mask = plan.prefill_masks[window] = torch.cat([cached, step], dim=1)
    return mask


def prefill_bias(plan: HpuStepPlan, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """prefill_mask as FusedSDPA's additive bias, [1, 1, q, k]: 0 where allowed, the dtype's minimum
    elsewhere (not -inf: the mask allows every row its own key, so no sum can turn into NaN)."""
    bias = plan.prefill_biases.get((window, dtype))
    if bias is None:
        mask = prefill_mask(plan, window)
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
        bias = plan.prefill_biases[window, dtype] = bias[None, None]
    return bias


def masked_attention(
    query: torch.Tensor,  # [B, q_len, num_heads, head_dim]
    key: torch.Tensor,  # [B, k_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [B, k_len, num_kv_heads, head_dim]
    allowed: torch.Tensor,  # [B or 1, q_len, k_len]
    layer: AttentionLayerParams,
) -> torch.Tensor:  # [B, q_len, num_heads, head_dim]
    """Batched attention under a mask, grouped-query by reshaping the queries (KV never repeated).

    Matmuls run in the query's dtype (the MME's bf16) and the softmax in float32. A masked score is
    the float32 minimum, not -inf: a row with nothing allowed averages instead of turning into NaN.
    """
    batch, q_len, num_heads, dim = query.shape
    num_kv = key.shape[2]
    q = query.reshape(batch, q_len, num_kv, num_heads // num_kv, dim).permute(0, 2, 3, 1, 4)
    k = key.to(query.dtype).permute(0, 2, 1, 3)[:, :, None]  # [B, kv, 1, k_len, dim]
    v = value.to(query.dtype).permute(0, 2, 1, 3)[:, :, None]
    scores = (q @ k.transpose(-1, -2)).float() * layer.scale  # [B, kv, group, q_len, k_len]
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(torch.float32).min)
    out = scores.softmax(-1).to(query.dtype) @ v  # [B, kv, group, q_len, dim]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, dim)


class HpuAttentionBackend(AttentionBackend[HpuStepPlan]):
    """Paged attention for Gaudi in static shapes; Habana's kernels reached only through `ops`."""

    name = "hpu"
    scratch_blocks = 1
    shape_only = True

    def __init__(self, ops: HabanaOps | None = None) -> None:
        self.ops: HabanaOps = ops if ops is not None else GaudiOps()

    def mark_step(self) -> None:
        self.ops.mark_step()

    def graph_wrap(self, module):  # noqa: ANN001, ANN201
        return self.ops.wrap_in_hpu_graph(module)

    def plan(self, metadata: AttentionMetadata) -> HpuStepPlan:
        return hpu_step_plan(metadata)

    def forward(self, query, key, value, kv_cache, plan: HpuStepPlan, layer: AttentionLayerParams):
        write_kv(key, value, kv_cache, plan)
        if plan.decode:
            return self._decode(query, kv_cache, plan, layer)
        return self._prefill(query, key, value, kv_cache, plan, layer)

    def _decode(self, query, kv_cache, plan: HpuStepPlan, layer: AttentionLayerParams):
        keys, values = gather_blocks(kv_cache, plan)
        mask = decode_mask(plan, layer.spec.sliding_window)
        return masked_attention(query[:, None], keys, values, mask, layer)[:, 0]

    def _prefill(self, query, key, value, kv_cache, plan: HpuStepPlan, layer: AttentionLayerParams):
        window = layer.spec.sliding_window
        key, value = key.to(query.dtype), value.to(query.dtype)
        if plan.num_columns:  # keys: every sequence's cached rows, then this step's
            cached = gather_blocks(kv_cache, plan)
            key, value = (
                torch.cat([c.reshape(-1, *c.shape[2:]).to(query.dtype), new])
                for c, new in zip(cached, (key, value))
            )
        if layer.softcap is not None:  # FusedSDPA has no softcap
            mask = prefill_mask(plan, window)
            return masked_attention(query[None], key[None], value[None], mask[None], layer)[0]
        # A lone sequence with nothing cached is plain causal: rows after it are padding.
        causal = plan.num_seqs == 1 and plan.num_columns == 0 and window is None
        bias = None if causal else prefill_bias(plan, window, query.dtype)
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, heads, rows, dim]
        out = self.ops.fused_sdpa(q, k, v, bias, causal, layer.scale)
        return out[0].transpose(0, 1)
