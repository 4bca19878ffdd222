"""Torch reference twins of the Triton kernels.

Every Triton kernel in this package is tested against a function here. They favour clarity over
speed: one sequence at a time, scores in float32 unless asked otherwise, grouped-query attention by
reshaping the queries against their KV head (KV heads are never repeated).

Layouts (agreed with the engine):
    kv_cache      [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = keys, 1 = values)
    slot_mapping  [num_tokens]   slot = block_id * block_size + offset, -1 = do not write
    block_tables  int32 [num_seqs, max_blocks_per_seq]
    query         [num_tokens, num_heads, head_dim], sequence i owns rows
                  query_start_loc[i]:query_start_loc[i+1] and they are the LAST q_len positions of
                  a context of seq_lens[i] tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tgserve.kernels.kv_format import dequantize_kv, quantize_kv


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's key and value at its slot of the paged cache; slot -1 is skipped.

    kv_scale [2, num_blocks, num_kv_heads, block_size] float32: the cache is 8-bit (e4m3 or
    int8), and each (token, KV head) row is stored scaled by its own scale, written beside it
    (`kv_format.quantize_kv`)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    if kv_scale is None:
        flat[0].index_copy_(0, slots, key[keep].to(kv_cache.dtype))
        flat[1].index_copy_(0, slots, value[keep].to(kv_cache.dtype))
        return
    block_size = kv_cache.shape[2]
    for i, x in enumerate((key, value)):
        q, scale = quantize_kv(x[keep], kv_cache.dtype)
        # Copied as bytes: torch's CPU indexing ops do not take float8 tensors.
        flat[i].view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
        kv_scale[i][slots // block_size, :, slots % block_size] = scale


def write_tail(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    tail: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """An 8-bit cache's full-precision tail (`server/kv_cache/tail_blocks.py`): each token stored
    into a block with a tail slot is also stored there, unquantized. tail: (cache [2, slots,
    block_size, num_kv_heads, head_dim] in the model's dtype, slot_of int32 [pool blocks])."""
    cache, slot_of = tail
    block_size = cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    tail_slot = slot_of[slots // block_size].long()
    has = tail_slot >= 0
    rows = tail_slot[has] * block_size + slots[has] % block_size
    flat = cache.view(2, -1, *cache.shape[-2:])
    flat[0].index_copy_(0, rows, key[keep][has].to(cache.dtype))
    flat[1].index_copy_(0, rows, value[keep][has].to(cache.dtype))


def current_block_from_tail(
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    tail: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` keys and values [length, H_kv, D] as read with a tail: its
    current block's rows (the block holding position length - 1) from that block's tail slot,
    where it has one."""
    cache, slot_of = tail
    block_size = cache.shape[2]
    column = (length - 1) // block_size
    block = int(block_table[column])
    slot = int(slot_of[block]) if block < slot_of.shape[0] else -1
    if slot < 0:
        return keys, values
    lo = column * block_size
    keys, values = keys.clone(), values.clone()
    keys[lo:length] = cache[0, slot, : length - lo].to(keys.dtype)
    values[lo:length] = cache[1, slot, : length - lo].to(values.dtype)
    return keys, values


def with_host_blocks(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    host: tuple[torch.Tensor, torch.Tensor | None, int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The device pool and the host blocks (`paged_decode`'s `host`) as one pool, host blocks after
    the device's: what a block table naming host blocks reads (copied, for clarity)."""
    host_cache, host_scale, first = host
    assert first == kv_cache.shape[1], "the twin joins pools without scratch blocks between them"
    # As bytes: torch's CPU cat does not take float8 tensors.
    joined = torch.cat([kv_cache.view(torch.uint8), host_cache.view(torch.uint8)], dim=1).view(kv_cache.dtype)
    if kv_scale is None:
        return joined, None
    return joined, torch.cat([kv_scale, host_scale], dim=1)


def fill_from_host(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    host_cache: torch.Tensor,
    host_scale: torch.Tensor | None,
    sources: torch.Tensor,  # int64 [num_kv_heads, picks]: host blocks
    targets: torch.Tensor,  # int64 [num_kv_heads, picks]: device blocks, -1: nothing to copy
) -> None:
    """The hot-block cache's fill (`kernels/host_fill.py`): for every (head, pick) with a target,
    that head's keys and values (and scales) of host block sources[head, pick] into device block
    targets[head, pick]."""
    heads, picks = (targets >= 0).nonzero(as_tuple=True)
    src, dst = sources[heads, picks], targets[heads, picks]
    for side in (0, 1):
        # As bytes: torch's CPU indexing takes no float8 tensors.
        kv_cache[side].view(torch.uint8)[dst, :, heads] = host_cache[side].view(torch.uint8)[src, :, heads]
        if kv_scale is not None:
            kv_scale[side][dst, heads] = host_scale[side][src, heads]


def gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` keys and values of one sequence, each [length, num_kv_heads, head_dim]:
    in the cache's dtype, or from an 8-bit cache (kv_scale given) dequantized to float32. With
    `host`, table entries past the pool's blocks name host blocks (`with_host_blocks`)."""
    if host is not None:
        kv_cache, kv_scale = with_host_blocks(kv_cache, kv_scale, host)
    block_size = kv_cache.shape[2]
    pos = torch.arange(length, device=kv_cache.device)
    slots = block_table[pos // block_size].long() * block_size + pos % block_size
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    if kv_scale is None:
        return flat[0, slots], flat[1, slots]
    pages, offsets = slots // block_size, slots % block_size
    as_bytes = flat.view(torch.uint8)  # torch's CPU indexing ops do not take float8 tensors
    return tuple(
        dequantize_kv(as_bytes[i, slots].view(kv_cache.dtype), kv_scale[i][pages, :, offsets]) for i in (0, 1)
    )


def update_key_summaries(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1: not stored
    key_summary: torch.Tensor,  # [2, num_blocks, num_kv_heads, head_dim]
    block_size: int,
) -> None:
    """Fold a step's keys into their blocks' minimum and maximum (selective decode's key summaries,
    `decode_selection.py`; twin of `summary_fold.py`). A block whose first slot is
    written starts over (it was free, or held another sequence's keys); the others extend what
    earlier steps folded in (a block filled over several prefill chunks or decode steps)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    keys = key[keep].to(key_summary.dtype)
    blocks = slots // block_size
    fresh = blocks[slots % block_size == 0]
    key_summary[0].index_fill_(0, fresh, float("inf"))
    key_summary[1].index_fill_(0, fresh, float("-inf"))
    index = blocks[:, None, None].expand_as(keys)
    key_summary[0].scatter_reduce_(0, index, keys, "amin")
    key_summary[1].scatter_reduce_(0, index, keys, "amax")


def block_scores(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one decode query per sequence
    key_summary: torch.Tensor,  # [2, num_blocks, num_kv_heads, head_dim]: keys' minimum, maximum
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_size: int,
    sink_blocks: int,
    recent_blocks: int,
    host_summary: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:  # float32 [num_seqs, num_kv_heads, width]
    """How much each block of a context may matter to the query, per KV head
    (`kernels/decode_selection.py`): Quest's bound sum_d max(q_d min_d, q_d max_d), the largest over
    the query heads that share the KV head; +inf for the sink's and the recent window's blocks;
    -inf for the current block (always read, after the chosen ones) and past the context. With
    `host_summary` (host blocks' summaries, the first host id), table entries from it on are host blocks."""
    if host_summary is not None:
        assert host_summary[1] == key_summary.shape[1], "the twin joins pools without scratch blocks between"
        key_summary = torch.cat([key_summary, host_summary[0]], dim=1)
    num_seqs, num_heads, dim = query.shape
    num_kv = key_summary.shape[2]
    low, high = (key_summary[i][block_tables.long()].float() for i in (0, 1))  # [S, W, Hkv, D]
    q = query.float().view(num_seqs, num_kv, num_heads // num_kv, dim)
    # max(q lo, q hi) = max(q, 0) hi + min(q, 0) lo: two products, nothing computed per key.
    bound = torch.einsum("skgd,swkd->skgw", q.clamp(min=0), high)
    bound = bound + torch.einsum("skgd,swkd->skgw", q.clamp(max=0), low)
    return forced_block_scores(bound.amax(dim=2), seq_lens, block_size, sink_blocks, recent_blocks)


def forced_block_scores(
    scores: torch.Tensor,  # float32 [num_seqs, num_kv_heads, width]: by block-table column
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_size: int,
    sink_blocks: int,
    recent_blocks: int,
) -> torch.Tensor:
    """Scores with selection's fixed choices applied: +inf for the sink's and the recent window's
    blocks (always read); -inf for the current block (read after the chosen ones) and past the
    context."""
    blocks = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    num_blocks = (seq_lens.long()[:, None] + block_size - 1) // block_size
    forced = (blocks < sink_blocks) | (blocks >= num_blocks - recent_blocks)
    scores = torch.where(forced[:, None, :], float("inf"), scores)
    return torch.where((blocks < num_blocks - 1)[:, None, :], scores, float("-inf"))


def candidate_scores(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one decode query per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    candidates: torch.Tensor,  # int64 [num_seqs, num_kv_heads, c]: block-table columns
    bound: torch.Tensor,  # float32 [num_seqs, num_kv_heads, width]: `block_scores`
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    key_copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # float32 [num_seqs, num_kv_heads, c]
    """Each candidate block's largest logit q . k over its keys and the query heads that share the
    KV head, from the cache itself; a candidate whose bound is infinite keeps it (the sink and the
    recent window: +inf; the current block and blocks past the context: -inf, never chosen).
    `host`: as `gather_kv` reads it. `key_copy`: (e4m3 keys [slots, block_size, num_kv_heads, D],
    scales [slots, num_kv_heads, block_size], slot_of int32 [host blocks]): a host block with a slot
    is read from its copy (`server/kv_cache/key_copies.py`)."""
    first = kv_cache.shape[1]
    if host is not None:
        kv_cache, kv_scale = with_host_blocks(kv_cache, kv_scale, host)
    num_seqs, num_heads, dim = query.shape
    num_kv = kv_cache.shape[3]
    pages = block_tables.long().gather(1, candidates.flatten(1)).view(candidates.shape)
    heads = torch.arange(num_kv, device=query.device)[None, :, None]
    keys = _block_head_keys(kv_cache[0], None if kv_scale is None else kv_scale[0], pages, heads)
    if key_copy is not None:
        copy_keys, copy_scales, slot_of = key_copy
        slots = key_copy_slots(pages, first, slot_of)
        copied = _block_head_keys(copy_keys, copy_scales, slots.clamp(min=0), heads)
        keys = torch.where((slots >= 0)[..., None, None], copied, keys)
    q = query.float().view(num_seqs, num_kv, num_heads // num_kv, dim)
    exact = torch.einsum("skgd,skctd->skgct", q, keys).amax(dim=(2, 4))
    given = bound.gather(2, candidates)
    return torch.where(torch.isinf(given), given, exact)


def key_copy_slots(pages: torch.Tensor, first: int, slot_of: torch.Tensor) -> torch.Tensor:
    """int64, `pages`' shape: each page's slot among the host blocks' key copies (`slot_of`, by host
    block); -1 for a device page (below `first`) and for a host block without a copy."""
    return torch.where(pages >= first, slot_of.long()[(pages - first).clamp(min=0)], -1)


def _block_head_keys(
    cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor, heads: torch.Tensor
) -> torch.Tensor:
    """float32 [S, Hkv, c, block_size, D]: keys of blocks `pages` [S, Hkv, c] for their KV heads,
    from keys [blocks, block_size, Hkv, D] (dequantized with scales [blocks, Hkv, block_size])."""
    if scale is None:
        return cache[pages, :, heads].float()
    as_bytes = cache.view(torch.uint8)[pages, :, heads].view(cache.dtype)  # CPU indexing takes no float8
    return dequantize_kv(as_bytes, scale[pages, heads])


def causal_mask(
    q_len: int, k_len: int, sliding_window: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[q_len, k_len] bool: queries are the last q_len of k_len positions; window w keeps (p-w, p]."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def softmax_with_sinks(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores; with `sink` (learned sink logits, shaped to broadcast
    against scores[..., :1]), each row's softmax takes one more key of its head's logit, dropped
    after: its share is what the other keys lose. Rows with no allowed key give zeros."""
    if sink is None:
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)
    sink = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def masked_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [k_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [k_len, num_kv_heads, head_dim]
    mask: torch.Tensor,  # bool [q_len, k_len] or per head [num_heads, q_len, k_len]
    scale: float,
    softcap: float | None = None,
    upcast: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim], query's dtype
    """Softmax attention under an explicit mask, grouped-query by reshaping the queries.

    upcast=False computes in the input dtype: the "low-precision torch" error that the
    flash-attention test rule compares a kernel's error against. Fully masked rows give zeros.
    sinks [num_heads]: each head's learned sink logit, one more key of zero value in every row.
    """
    q_len, num_heads, dim = query.shape
    num_kv, dim_v = key.shape[1], value.shape[2]
    group = num_heads // num_kv
    dt = torch.float32 if upcast else query.dtype
    q = query.to(dt).view(q_len, num_kv, group, dim).permute(1, 2, 0, 3)  # [kv, g, q, d]
    k = key.to(dt).permute(1, 0, 2)[:, None]  # [kv, 1, k, d]
    v = value.to(dt).permute(1, 0, 2)[:, None]
    scores = (q @ k.transpose(-1, -2)) * scale  # [kv, g, q, k]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dim() == 3:
        mask = mask.view(num_kv, group, q_len, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_kv, group, 1, 1))
    out = probs @ v  # [kv, g, q, dv]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, dim_v).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    upcast: bool = True,
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    sinks: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Variable-length attention over the paged cache: prefill chunks, prefix hits and decode alike
    (an 8-bit cache with kv_scale: its keys and values dequantized, as `gather_kv` gives them; with
    `host`, host blocks read as `gather_kv` reads them; sinks: as `masked_attention` takes them;
    tail: each sequence's current block read as `current_block_from_tail` reads it)."""
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        k, v = gather_kv(kv_cache, block_tables[i], seq_len, kv_scale, host)
        if tail is not None:
            k, v = current_block_from_tail(k, v, block_tables[i], seq_len, tail)
        mask = causal_mask(hi - lo, seq_len, sliding_window, query.device)
        out[lo:hi] = masked_attention(query[lo:hi], k, v, mask, scale, softcap, upcast, sinks)
    return out


def selected_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    chosen: torch.Tensor,  # int64 [num_seqs, num_kv_heads, k - 1]: each KV head's chosen block-table columns
    lengths: torch.Tensor,  # int32 [num_seqs]: the tokens they and the current block hold; 0: dense
    scale: float,
    softcap: float | None = None,
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    sinks: torch.Tensor | None = None,
    hot: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Selective decode (`kernels/decode_selection.py`): each KV head's query heads attend over
    the keys of that head's chosen blocks and the current block, as if they were the context
    (`host`: as `gather_kv` reads it; sinks: as `masked_attention` takes them; `hot`: per KV head
    the device block holding each host block, or -1, read instead: `paged_decode`'s; tail: the
    current block read as `current_block_from_tail` reads it)."""
    out = torch.zeros_like(query)
    num_kv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = query.shape[1] // num_kv
    for s, (n, kept) in enumerate(zip(seq_lens.tolist(), lengths.tolist())):
        current = block_tables[s, (n - 1) // block_size].reshape(1)
        for h in range(num_kv):
            table, length = (
                (torch.cat([block_tables[s, chosen[s, h]], current]), kept)
                if kept > 0
                else (block_tables[s], n)
            )
            if hot is not None:
                table = _through_hot_blocks(table, hot[h], host[2])
            k, v = gather_kv(kv_cache, table, length, kv_scale, host)
            if tail is not None:
                k, v = current_block_from_tail(k, v, table, length, tail)
            heads = slice(h * group, (h + 1) * group)
            allowed = torch.ones(1, length, dtype=torch.bool, device=query.device)
            out[s, heads] = masked_attention(query[s : s + 1, heads], k[:, h : h + 1], v[:, h : h + 1], allowed,
                                             scale, softcap, sinks=None if sinks is None else sinks[heads])[0]  # fmt: skip
    return out


def _through_hot_blocks(table: torch.Tensor, hot_row: torch.Tensor, first: int) -> torch.Tensor:
    """`table` with each host block (entry >= first) that `hot_row` maps to a device block replaced by it."""
    cached = hot_row[(table.long() - first).clamp(min=0)].to(table.dtype)
    return torch.where((table >= first) & (cached >= 0), cached, table)


def varlen_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    upcast: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal attention of fresh prompts packed back to back (keys = the prompt itself)."""
    out = torch.zeros_like(query)
    starts = cu_seqlens.tolist()
    for lo, hi in zip(starts, starts[1:]):
        if hi == lo:
            continue
        mask = causal_mask(hi - lo, hi - lo, sliding_window, query.device)
        out[lo:hi] = masked_attention(
            query[lo:hi], key[lo:hi], value[lo:hi], mask, scale, softcap, upcast, sinks
        )
    return out


# ---- a decoder layer's elementwise glue: each computed exactly as the models' eager code did ----


def _normed_float32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32: the step every RMSNorm order shares."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of the last dim in float32, cast back to x's dtype before the weight multiplies it."""
    return weight * _normed_float32(x, eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add, then the next norm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, cast back (Llama casts before
    it scales)."""
    return (_normed_float32(x, eps) * (1.0 + weight.float())).type_as(x)


def float_scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by the weight in float32, then cast back (OLMo's and others' in transformers;
    Llama casts before it scales)."""
    return (weight * _normed_float32(x, eps)).to(x.dtype)


def gemma_norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual + gemma_rms_norm(x), and with next_weight that sum's gemma_rms_norm by it)."""
    hidden = residual + gemma_rms_norm(x, weight, eps)
    return hidden, None if next_weight is None else gemma_rms_norm(hidden, next_weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # [T, 1, D] or [T, D]
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX style) rotary embedding of queries and keys."""
    if cos.dim() == query.dim() - 1:  # [T, D]: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating of a fused [..., 2I] gate/up projection: silu(gate) * up."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's gating (Gemma) of a fused [..., 2I] gate/up projection: gelu_tanh(gate) * up."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    gating: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """[T, H]: for each token, the sum over its chosen experts e (ids [T, k]) of weights[t, slot] x
    down_e(silu(gate_e x) * up_e x), with w_gate_up [E, 2I, H] and w_down [E, H, I]. Expert by expert
    over the rows that chose it, added in expert order (as transformers' MoE blocks do). biases:
    (gate_up [E, 2I], down [E, H]) added to each projection (gpt-oss); gating(gate, up): the
    activation in place of SiLU(gate) * up (`moe_routing.ClampedSwiGLU`)."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        bias_gate_up, bias_down = (None, None) if biases is None else (biases[0][expert], biases[1][expert])
        gate_up = F.linear(x[token], w_gate_up[expert], bias_gate_up)
        hidden = silu_and_mul(gate_up) if gating is None else gating(*gate_up.chunk(2, dim=-1))
        down = F.linear(hidden, w_down[expert], bias_down) * weights[token, slot, None]
        out.index_add_(0, token, down.to(out.dtype))
    return out


# ---- sparse patterns as element-level masks (what MInference's patterns mean, before blocking) ----


def a_shape_mask(n: int, sink: int, local: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, n] causal mask keeping the first `sink` keys and the last `local` keys of each query."""
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    return (k <= q) & ((k < sink) | (q - k < local))


def vertical_slash_mask(n: int, columns: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[n, n] causal mask keeping whole key columns and whole diagonals (offset = query - key)."""
    q = torch.arange(n, device=columns.device)[:, None]
    k = torch.arange(n, device=columns.device)[None, :]
    keep_col = torch.zeros(n, dtype=torch.bool, device=columns.device)
    keep_col[columns.long()] = True
    keep_diag = torch.zeros(n, dtype=torch.bool, device=columns.device)
    keep_diag[offsets.long()] = True
    causal = k <= q
    return causal & (keep_col[None, :] | keep_diag[(q - k).clamp(min=0)])


def block_mask_to_dense(block_mask: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Expand a [nq_blocks, nk_blocks] bool block mask to an [n, n] causal element mask."""
    dense = block_mask.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :n]
    return dense & causal_mask(n, n, device=block_mask.device)
