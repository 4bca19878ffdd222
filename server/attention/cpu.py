"""The cpu backend: attention in plain torch over the paged cache.

It is the reference the CUDA and HPU paths are tested against. Its pieces are the torch twins of
the kernels (tgserve.kernels.reference); on top of them it batches all decoding sequences into one
gather and uses SDPA where no softcap is needed. Grouped-query attention never repeats KV heads.
"""

from __future__ import annotations

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


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]: one query per sequence, at position seq_len - 1
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    layer: AttentionLayerParams,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """All decoding sequences at once: whole blocks gathered, padded to the longest, padding masked out."""
    batch, num_heads, dim = query.shape
    block_size = kv_cache.shape[2]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    tables = block_tables[:, :num_blocks].reshape(-1).long()
    # [2, B, L, H_kv, D] with L = num_blocks * block_size: one row gather of whole blocks (index_select
    # copies contiguous rows, about twice as fast on CPU as advanced indexing), no per-token slots.
    blocks = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, tables)
    keys, values = blocks.view(2, batch, num_blocks * block_size, *kv_cache.shape[-2:])
    positions = torch.arange(keys.shape[1], device=query.device)
    query_pos = (seq_lens.long() - 1)[:, None]
    allowed = positions[None, :] <= query_pos
    if layer.spec.sliding_window is not None:
        allowed &= positions[None, :] > query_pos - layer.spec.sliding_window
    if layer.softcap is None:
        out = F.scaled_dot_product_attention(
            query[:, :, None, :],
            keys.transpose(1, 2).to(query.dtype),
            values.transpose(1, 2).to(query.dtype),
            attn_mask=allowed[:, None, None, :],
            scale=layer.scale,
            enable_gqa=True,
        )
        return out[:, :, 0, :]
    num_kv = keys.shape[2]
    q = query.float().view(batch, num_kv, num_heads // num_kv, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", q, keys.float()) * layer.scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), values.float())
    return out.reshape(batch, num_heads, dim).to(query.dtype)


class CpuAttentionBackend(AttentionBackend):
    """Paged attention in torch: decoding sequences batched together, prefill chunks one at a time."""

    name = "cpu"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, layer: AttentionLayerParams):
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        decode_seqs = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
        if len(decode_seqs) > 1:
            rows = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
            seqs = torch.tensor(decode_seqs, device=query.device)
            out[rows] = decode_attention(
                query[rows], kv_cache, metadata.block_tables[seqs], metadata.seq_lens[seqs], layer
            )
        batched = set(decode_seqs) if len(decode_seqs) > 1 else set()
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            if i in batched:
                continue
            begin, end = starts[i], starts[i + 1]
            if end - begin == seq_len:  # a fresh prompt: its context is exactly this step's keys
                k, v = key[begin:end], value[begin:end]
            else:
                k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
            allowed = causal_mask(end - begin, seq_len, layer.spec.sliding_window, query.device)
            out[begin:end] = attend(query[begin:end], k, v, allowed, layer)
        return out
