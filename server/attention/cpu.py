"""The cpu backend: attention in plain torch over the paged cache.

It is the reference the CUDA and HPU paths are tested against. Its pieces are the torch twins of
the kernels (tgserve.kernels.reference); on top of them it batches all decoding sequences into one
gather and uses SDPA where no softcap is needed. Grouped-query attention never repeats KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tgserve.kernels.reference import causal_mask, gather_kv, masked_attention, write_kv
from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams
from tgserve.server.attention.metadata import AttentionMetadata


def attend(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    allowed: torch.Tensor,  # [q_len, seq_len]
    layer: AttentionLayerParams,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """One sequence's queries against its context; SDPA unless scores need softcapping."""
    if layer.softcap is None:
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1),
            key.transpose(0, 1).to(query.dtype),
            value.transpose(0, 1).to(query.dtype),
            attn_mask=allowed,
            scale=layer.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
    return masked_attention(query, key, value, allowed, layer.scale, layer.softcap)


@dataclass
class StepPlan:
    """What every layer of one step shares: which sequences decode together, their block ids, masks.

    Built once per step (cached on the metadata) so that layers do no per-sequence Python work.
    """

    decode_rows: torch.Tensor | None  # flat-batch rows of the batched decode queries
    decode_block_ids: torch.Tensor | None  # [B * num_blocks], row-major over the decoding sequences
    decode_num_blocks: int
    decode_query_pos: torch.Tensor | None  # [B, 1]
    prefill_seqs: list[tuple[int, int, int, int]]  # (sequence, begin, end, seq_len) attended one by one
    writes_every_slot: bool  # no slot -1: keys and values go in without a mask
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)


def step_plan(metadata: AttentionMetadata, block_size: int) -> StepPlan:
    cached = metadata.backend_cache.get("cpu")
    if cached is not None:
        return cached
    starts = metadata.query_start_loc_cpu
    decode = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
    if len(decode) < 2:  # a lone decode goes through the per-sequence path
        decode = []
    batched = set(decode)
    prefill = [
        (i, starts[i], starts[i + 1], n) for i, n in enumerate(metadata.seq_lens_cpu) if i not in batched
    ]
    plan = StepPlan(None, None, 0, None, prefill, bool((metadata.slot_mapping >= 0).all()))
    if decode:
        device = metadata.slot_mapping.device
        seqs = torch.tensor(decode, device=device)
        seq_lens = metadata.seq_lens[seqs].long()
        plan.decode_num_blocks = -(-max(metadata.seq_lens_cpu[i] for i in decode) // block_size)
        plan.decode_rows = torch.tensor([starts[i] for i in decode], device=device)
        plan.decode_block_ids = metadata.block_tables[seqs, : plan.decode_num_blocks].reshape(-1).long()
        plan.decode_query_pos = (seq_lens - 1)[:, None]
    metadata.backend_cache["cpu"] = plan
    return plan


def decode_mask(plan: StepPlan, block_size: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, L] True where a decode query may attend (causal, window), cached per window."""
    key = ("decode", sliding_window)
    if key not in plan.masks:
        query_pos = plan.decode_query_pos
        positions = torch.arange(plan.decode_num_blocks * block_size, device=query_pos.device)[None, :]
        allowed = positions <= query_pos
        if sliding_window is not None:
            allowed &= positions > query_pos - sliding_window
        plan.masks[key] = allowed[:, None, None, :]
    return plan.masks[key]


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]: one query per sequence, at position seq_len - 1
    kv_cache: torch.Tensor,
    plan: StepPlan,
    layer: AttentionLayerParams,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """All decoding sequences at once: whole blocks gathered, padded to the longest, padding masked out."""
    batch, num_heads, dim = query.shape
    block_size = kv_cache.shape[2]
    # [2, B, L, H_kv, D] with L = num_blocks * block_size: one row gather of whole blocks (index_select
    # copies contiguous rows, about twice as fast on CPU as advanced indexing), no per-token slots.
    blocks = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, plan.decode_block_ids)
    keys, values = blocks.view(2, batch, plan.decode_num_blocks * block_size, *kv_cache.shape[-2:])
    allowed = decode_mask(plan, block_size, layer.spec.sliding_window)
    if layer.softcap is None:
        out = F.scaled_dot_product_attention(
            query[:, :, None, :],
            keys.transpose(1, 2).to(query.dtype),
            values.transpose(1, 2).to(query.dtype),
            attn_mask=allowed,
            scale=layer.scale,
            enable_gqa=True,
        )
        return out[:, :, 0, :]
    num_kv = keys.shape[2]
    q = query.float().view(batch, num_kv, num_heads // num_kv, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", q, keys.float()) * layer.scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), values.float())
    return out.reshape(batch, num_heads, dim).to(query.dtype)


class CpuAttentionBackend(AttentionBackend):
    """Paged attention in torch: decoding sequences batched together, prefill chunks one at a time."""

    name = "cpu"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, layer: AttentionLayerParams):
        plan = step_plan(metadata, kv_cache.shape[2])
        if plan.writes_every_slot:
            flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
            flat[0].index_copy_(0, metadata.slot_mapping, key.to(kv_cache.dtype))
            flat[1].index_copy_(0, metadata.slot_mapping, value.to(kv_cache.dtype))
        else:
            write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = decode_attention(query[plan.decode_rows], kv_cache, plan, layer)
        window = layer.spec.sliding_window
        for i, begin, end, seq_len in plan.prefill_seqs:
            if end - begin == seq_len:  # a fresh prompt: its context is exactly this step's keys
                k, v = key[begin:end], value[begin:end]
            else:
                k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
            mask_key = ("prefill", i, window)
            if mask_key not in plan.masks:
                plan.masks[mask_key] = causal_mask(end - begin, seq_len, window, query.device)
            out[begin:end] = attend(query[begin:end], k, v, plan.masks[mask_key], layer)
        return out
