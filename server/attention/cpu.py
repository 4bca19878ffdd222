"""The cpu backend: attention in plain torch over the paged cache.

It is the reference the CUDA and HPU paths are tested against, so it favours clarity: one sequence
at a time, keys gathered through the block table, scores in float32, grouped-query attention by
reshaping the queries (KV heads are never repeated).
"""

from __future__ import annotations

import torch

from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams
from tgserve.server.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's key and value at its slot; slot -1 means "do not store"."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slots, key[keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value[keep].to(kv_cache.dtype))


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len keys and values of one sequence: [seq_len, num_kv_heads, head_dim] each."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    return flat[0, slots], flat[1, slots]


def attention_mask(
    q_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, seq_len] True where a query may attend: causal, and within the window if any."""
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return allowed


def attend(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    allowed: torch.Tensor,  # [q_len, seq_len]
    layer: AttentionLayerParams,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, num_heads, dim = query.shape
    num_kv = key.shape[1]
    group = num_heads // num_kv
    # [num_kv, group * q_len, dim]: the queries sharing a KV head are stacked against it.
    q = query.float().view(q_len, num_kv, group, dim).permute(1, 2, 0, 3).reshape(num_kv, group * q_len, dim)
    k = key.float().permute(1, 0, 2)
    v = value.float().permute(1, 0, 2)
    scores = torch.bmm(q, k.transpose(1, 2)) * layer.scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.view(num_kv, group, q_len, -1).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv, group * q_len, -1)
    out = torch.bmm(probs, v).view(num_kv, group, q_len, dim)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, dim).to(query.dtype)


class CpuAttentionBackend(AttentionBackend):
    """Paged attention in torch, one sequence at a time."""

    name = "cpu"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, layer: AttentionLayerParams):
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            begin, end = starts[i], starts[i + 1]
            k, v = gather_context(kv_cache, metadata.block_tables[i], seq_len)
            allowed = attention_mask(end - begin, seq_len, layer.spec.sliding_window, query.device)
            out[begin:end] = attend(query[begin:end], k, v, allowed, layer)
        return out
