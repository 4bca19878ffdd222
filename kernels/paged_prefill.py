"""Triton variable-length prefill attention, over the paged cache or over a fresh packed prompt.

Twins: `reference.paged_attention` (paged=True: chunked prefill, prefix-cache hits, mixed
prefill+decode batches) and `reference.varlen_attention` (paged=False: fresh prompts whose keys
are the packed prompt itself).

One launch serves every sequence: the grid is (query tiles, KV heads) with a tile -> sequence map
built on the device (no host sync, shape-only grid). Grouped-query natively: a tile's rows are
BLOCK_Q query tokens x the `group` query heads sharing one KV head (row = token * group + head),
so each key/value tile is loaded once for the whole group.

With an 8-bit cache's tail (`server/kv_cache/tail_blocks.py`), a sequence whose current block has
a tail slot reads that block from the slot, in the model's dtype, in a tile after the pool's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import (
    attend_tile,
    block_address,
    dot_precision,
    fold_sink,
    interpreting,
    pow2,
)


# The block table's width changes with the step's longest context: not specialised, so a new
# width divisible by 16 (or not) does not compile another kernel on first use.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    out_ptr,
    bt_ptr,
    q_start_ptr,
    seq_lens_ptr,
    tile_seq_ptr,
    cu_tiles_ptr,
    sm_scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ka,
    stride_kb,
    stride_kh,
    num_kv_heads,
    stride_bt,
    group,
    head_dim,
    hk_ptr,
    hv_ptr,
    hks_ptr,
    hvs_ptr,
    first_host,
    stride_h_block,
    stride_hs_block,
    sinks_ptr,
    tail_ptr,
    tail_of_ptr,
    stride_t_kv,
    stride_t_slot,
    stride_t_off,
    stride_t_head,
    PAGED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALED: tl.constexpr = False,
    HOST: tl.constexpr = False,
    SINKS: tl.constexpr = False,
    TAIL_SLOTS: tl.constexpr = False,
    TAIL_TILE: tl.constexpr = 16,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile_id)
    tile = tile_id - tl.load(cu_tiles_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        ctx = q_len
        if PAGED:
            ctx = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        tok = tile * BLOCK_Q + rows // group
        row_ok = (rows // group < BLOCK_Q) & (tok < q_len)
        dim_ok = dims < head_dim
        q_pos = ctx - q_len + tok
        head = kv_head * group + rows % group
        q_rows = (q_start + tok).to(tl.int64)
        row_mask = row_ok[:, None] & dim_ok[None, :]
        q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptrs, mask=row_mask, other=0.0)

        # Keys this tile can see: up to its last query, and from the window of its first query.
        hi = ctx - q_len + tl.minimum((tile + 1) * BLOCK_Q, q_len)
        lo = 0
        if USE_WINDOW:
            lo = (tl.maximum(ctx - q_len + tile * BLOCK_Q - window + 1, 0) // BLOCK_N) * BLOCK_N

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        table = bt_ptr + seq.to(tl.int64) * stride_bt
        # The current block's tail slot (TAIL_SLOTS): its rows come from the slot, after the pool's.
        tail_slot = -1
        tail_lo = (ctx - 1) // BLOCK_SIZE * BLOCK_SIZE
        pool_hi = hi
        if TAIL_SLOTS:
            current_page = tl.load(table + (ctx - 1) // BLOCK_SIZE)
            if current_page < first_host:
                tail_slot = tl.load(tail_of_ptr + current_page)
            if tail_slot >= 0:
                pool_hi = tl.minimum(hi, tail_lo)
        for start in range(lo, pool_hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            in_ctx = pos < pool_hi
            if PAGED:  # pages past the device pool's (HOST) are host blocks, read where they lie
                page = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
                within = (pos % BLOCK_SIZE) * stride_kb + kv_head * stride_kh
                k_at = block_address(k_ptr, hk_ptr, page, first_host, stride_ka, stride_h_block, within, HOST)
                v_at = block_address(v_ptr, hv_ptr, page, first_host, stride_ka, stride_h_block, within, HOST)
            else:
                base = (q_start + pos).to(tl.int64) * stride_ka + kv_head * stride_kh
                k_at, v_at = k_ptr + base, v_ptr + base
            kv_mask = in_ctx[:, None] & dim_ok[None, :]
            k = tl.load(k_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if SCALED:  # an 8-bit cache (paged only): each (token, KV head) row times its scale
                # [2, blocks, KV heads, BLOCK_SIZE]: a page's scales of this head are one contiguous run.
                run, page_run = kv_head * BLOCK_SIZE + pos % BLOCK_SIZE, num_kv_heads * BLOCK_SIZE
                ks_at = block_address(ks_ptr, hks_ptr, page, first_host, page_run, stride_hs_block, run, HOST)
                vs_at = block_address(vs_ptr, hvs_ptr, page, first_host, page_run, stride_hs_block, run, HOST)
                k_scale = tl.load(ks_at, mask=in_ctx, other=0.0)
                v_scale = tl.load(vs_at, mask=in_ctx, other=0.0)
                k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            mask = (pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
            if TAIL_SLOTS:  # the pool's tiles may end before the tile's queries do (at the tail)
                mask = mask & in_ctx[None, :]
            if USE_WINDOW:
                mask = mask & (pos[None, :] > q_pos[:, None] - window)
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, mask, sm_scale, softcap,
                                        USE_SOFTCAP, PRECISION)  # fmt: skip
        if TAIL_SLOTS:
            if (tail_slot >= 0) & (hi > tail_lo):
                t_row = tl.arange(0, TAIL_TILE)
                t_pos = tail_lo + t_row
                in_tail = (t_row < BLOCK_SIZE) & (t_pos < hi)
                t_at = tail_ptr + tail_slot.to(tl.int64) * stride_t_slot + t_row * stride_t_off
                t_at = t_at + kv_head * stride_t_head
                t_mask = in_tail[:, None] & dim_ok[None, :]
                t_k = tl.load(t_at[:, None] + dims[None, :], mask=t_mask, other=0.0).to(q.dtype)
                t_v = tl.load(t_at[:, None] + stride_t_kv + dims[None, :], mask=t_mask, other=0.0).to(q.dtype)
                t_allowed = (t_pos[None, :] <= q_pos[:, None]) & row_ok[:, None] & in_tail[None, :]
                if USE_WINDOW:
                    t_allowed = t_allowed & (t_pos[None, :] > q_pos[:, None] - window)
                acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, t_k, t_v, t_allowed, sm_scale, softcap,
                                            USE_SOFTCAP, PRECISION)  # fmt: skip

        if SINKS:  # each head's learned sink, one more key of zero value
            acc, l_i = fold_sink(acc, m_i, l_i, tl.load(sinks_ptr + head).to(tl.float32))
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def tile_shape(group: int, head_dim: int, block_m: int | None, block_n: int | None) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_Q tokens per tile, BLOCK_N keys per step) for a GQA group size."""
    small = interpreting()
    block_m = block_m or (16 if small else (128 if head_dim <= 128 else 64))
    block_m = max(block_m, pow2(group))  # a tile holds at least one token's whole group
    block_n = block_n or (16 if small else 64)
    return block_m, max(1, block_m // group), block_n


def tile_map(
    query_start_loc: torch.Tensor, block_q: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Map each program to (sequence, tile within it) on the device.

    The grid size num_tokens // block_q + num_seqs bounds sum(ceil(q_len / block_q)) from shapes
    alone; surplus programs land on the last sequence past its end and exit at once.
    """
    num_seqs = query_start_loc.numel() - 1
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    cu_tiles = torch.zeros(num_seqs + 1, dtype=torch.int32, device=query_start_loc.device)
    cu_tiles[1:] = torch.cumsum((q_lens + block_q - 1) // block_q, 0)
    grid = num_tokens // block_q + num_seqs
    ids = torch.arange(grid, device=query_start_loc.device, dtype=torch.int32)
    tile_seq = torch.searchsorted(cu_tiles[1:], ids, right=True).clamp_(max=num_seqs - 1).to(torch.int32)
    return tile_seq, cu_tiles, grid


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor | None,
    block_m: int | None,
    block_n: int | None,
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    sinks: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    paged = block_tables is not None
    num_kv_heads = key.shape[-2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0 or query_start_loc.numel() < 2:
        return out
    assert query.stride(2) == 1 and key.stride(-1) == 1 and out.stride(2) == 1
    block_m, block_q, block_n = tile_shape(group, head_dim, block_m, block_n)
    tile_seq, cu_tiles, grid = tile_map(query_start_loc, block_q, num_tokens)
    if paged:
        strides = (key.stride(0), key.stride(1), key.stride(2))
        block_size, table, table_stride = key.shape[1], block_tables, block_tables.stride(0)
    else:
        if value.stride() != key.stride():  # the kernel reads both through key's strides
            key, value = key.contiguous(), value.contiguous()
        strides = (key.stride(0), 0, key.stride(1))
        block_size, table, table_stride = 1, query_start_loc, 0
    assert kv_scale is None or (paged and kv_scale.is_contiguous())
    scales = (key, value) if kv_scale is None else (kv_scale[0], kv_scale[1])  # unread unscaled
    # Host blocks (paged_decode's `host`): unread placeholders without.
    host_cache, host_scale, first_host = host or (key.expand(2, *key.shape), None, key.shape[0])
    assert host is None or (paged and host_cache.stride()[2:] == key.stride()[1:])
    host_scales = scales if host_scale is None else (host_scale[0], host_scale[1])
    assert tail is None or kv_scale is not None
    tail_cache, tail_of = tail or (key.expand(2, *key.shape), query_start_loc)  # unread without TAIL_SLOTS
    _prefill_kernel[(grid, num_kv_heads)](
        query, key, value, *scales, out, table, query_start_loc, seq_lens, tile_seq, cu_tiles,
        scale, softcap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *strides, num_kv_heads,
        table_stride,
        group, head_dim,
        host_cache[0], host_cache[1], *host_scales, first_host, host_cache.stride(1), host_scales[0].stride(0),
        query if sinks is None else sinks.float().contiguous(),
        tail_cache, tail_of, *tail_cache.stride()[:4],
        PAGED=paged, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None, PRECISION=dot_precision(query.dtype), SCALED=kv_scale is not None,
        HOST=host is not None, SINKS=sinks is not None, TAIL_SLOTS=tail is not None,
        TAIL_TILE=max(16, pow2(block_size)), num_warps=4 if interpreting() else 8,
        num_stages=1 if interpreting() else 2,
    )  # fmt: skip
    return out


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs], context including this step's tokens
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    sinks: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Queries of each sequence (its last q_len positions) against all its earlier paged KV; with
    kv_scale [2, num_blocks, num_kv_heads, block_size] float32, an 8-bit cache with these scales;
    with `host` (as paged_decode takes it), table entries from its first id on are host blocks;
    sinks [num_heads]: learned per-head sink logits (a key of zero value in every row); tail: an
    8-bit cache's (tail slots, block -> slot map), as paged_decode takes it."""
    return _launch(query, kv_cache[0], kv_cache[1], query_start_loc, seq_lens, block_tables,
                   scale, sliding_window, softcap, out, block_m, block_n, kv_scale, host, sinks, tail)  # fmt: skip


def varlen_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,  # int32 [num_seqs + 1]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of fresh prompts packed back to back (keys read straight from `key`)."""
    return _launch(query, key, value, cu_seqlens, cu_seqlens, None,
                   scale, sliding_window, softcap, out, block_m, block_n, sinks=sinks)  # fmt: skip
