"""Triton paged decode attention: one query token per sequence against its paged KV.

Twin: `reference.paged_attention` with one query per sequence.

Grouped-query natively: a program owns one KV head of one sequence and all the query heads that
share it (padded to 16 rows for tl.dot), so each key/value is read from HBM once per group, never
repeated. Long contexts with few sequences are split along the context (flash-decoding): each
split writes an unnormalised partial output plus its running max and sum, then counts itself in on
a per-(sequence, KV head) counter; the split that arrives last merges them all and resets the
counter. One launch, not two: a separate merge kernel cost about 2.7 us per layer at batch 1 on an
H200. The grid depends only on tensor shapes, so it can be captured in a CUDA graph; each sequence
divides its own context among the splits, so a graph sized for long contexts still spreads a short
one over many programs instead of leaving it to a few. Given the step's keys and values
(`step_kv`), the kernel also stores them into the cache, so decode needs no separate KV-write launch.
With an 8-bit cache's tail (`server/kv_cache/tail_blocks.py`), a sequence whose current block has
a tail slot reads that block from the slot, in the model's dtype, in a tile of its own after the
pool's tiles; the step's key and value are stored there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.decode_launch import choose_splits, launch_tile, merge_splits, merge_tile, split_counters
from tgserve.kernels.triton_common import (
    attend_tile,
    block_address,
    dot_precision,
    fold_sink,
    pdl,
    pow2,
    scaled_kv_rows,
    wait_for_inputs,
    widen_f16,
)

# The fp8 path's probabilities carry the values' scales times this power of two (F16_PRODUCTS below).
V_WEIGHT: tl.constexpr = tl.constexpr(256.0)
# Over an fp8 cache, each tile's scales are loaded a tile ahead, into registers: Triton's pipeliner
# prefetches only the loads that feed a product (the keys and values), so every tile waited for its
# scales. On an H200 (one layer, 32 query / 8 KV heads of 128), batch 256 x 640 tokens 175 -> 167 us
# (bf16 163), 64 x 4,096 265 -> 253 (bf16 250), batch 1 x 1M 989 -> 960 (bf16 1,186); outputs
# bit-identical (docs/benchmarks/2026-12-04-gc-pauses-and-fp8-scales-h200.md).
FP8_SCALES_AHEAD = True
# Over an fp8 cache, the keys past the last whole tile go in tiles of half as many: a 128-key tile
# costs about twice a 64-key one however few of its keys are in the context. One layer on an H200,
# us, before / after (bf16's 64-key tiles): batch 256 x 520 tokens 161 / 151 (141), x 600 165 / 170
# (158; two half tiles), x 640 167 / 157 (163); 64 x 4,096 254 / 217 (250); 1 x 1M 969 / 766
# (1,184); outputs bit-identical. Contexts with no rest gain too, likely from the whole tiles'
# uniform masks (see TAIL_N in the kernel).
FP8_HALF_TAIL = True


# The integers a step's shape sets (the split count, the block table's width) are not specialised:
# Triton would compile apart the values divisible by 16, and with the merge tile fixed per model
# (`decode_launch.merge_tile`) every step of a model then shares one compiled kernel, so a new
# prompt length or batch size never pays a compile on first use.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    counters_ptr,
    new_k_ptr,
    new_v_ptr,
    slot_ptr,
    chosen_ptr,
    chosen_lens_ptr,
    summary_ptr,
    stride_chosen_seq,
    stride_chosen_head,
    stride_sum_side,
    stride_sum_block,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    sm_scale,
    softcap,
    window,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    num_kv_heads,
    stride_bt,
    group,
    head_dim,
    num_splits,
    hk_ptr,
    hv_ptr,
    hks_ptr,
    hvs_ptr,
    num_device_blocks,
    stride_h_block,
    stride_hs_block,
    sinks_ptr,
    hot_ptr,
    stride_hot,
    tail_ptr,
    tail_of_ptr,
    stride_t_kv,
    stride_t_slot,
    stride_t_off,
    stride_t_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    WRITE: tl.constexpr = False,
    SCALED: tl.constexpr = False,
    INT8: tl.constexpr = False,
    SELECT: tl.constexpr = False,
    SUMMARY: tl.constexpr = False,
    F16_PRODUCTS: tl.constexpr = False,
    PDL: tl.constexpr = False,
    HOST: tl.constexpr = False,
    SCALE_AHEAD: tl.constexpr = False,
    TAIL_N: tl.constexpr = 0,
    SINKS: tl.constexpr = False,
    HOT: tl.constexpr = False,
    TAIL_SLOTS: tl.constexpr = False,
    TAIL_TILE: tl.constexpr = 16,
):
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq)
    table = bt_ptr + seq.to(tl.int64) * stride_bt
    # Selective decode: this KV head's chosen blocks (their columns in the block table, in any
    # order), then the current block, read as a context of their length; a length of 0 reads the
    # whole table.
    chosen_row = chosen_ptr
    chosen_len = 0
    hot_row = hot_ptr + kv_head * stride_hot  # this head's hot-block map (HOT)
    current = (ctx - 1) // BLOCK_SIZE  # the current block's column
    if SELECT:
        chosen_len = tl.load(chosen_lens_ptr + seq)
        if chosen_len > 0:
            ctx = chosen_len
            chosen_row = chosen_ptr + seq.to(tl.int64) * stride_chosen_seq + kv_head * stride_chosen_head
    # The query's position in the context read (with selection, in the current block, which comes
    # last: the same offset in the block, so the same slot).
    q_pos = ctx - 1
    last = (ctx - 1) // BLOCK_SIZE  # the current block's place in the context read

    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group + rows
    row_ok = rows < group
    dim_ok = dims < head_dim
    row_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=row_mask, other=0.0
    )
    if F16_PRODUCTS:
        q = q.to(tl.float16)

    # This sequence's context in num_splits whole tiles' worth each: splits past its end have nothing.
    partition = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * partition
    hi = tl.minimum(lo + partition, ctx)
    first = 0
    if USE_WINDOW:
        first = q_pos - window + 1
        # Tiles wholly before the window are skipped; start stays BLOCK_N-aligned.
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)

    # The current block's tail slot (TAIL_SLOTS): its positions, from `tail_lo` in the context
    # read, are read from the slot after the pool's tiles, whose scores stop at `pool_end`. The
    # tiles' loads and loop bounds stay the pool's, so nothing waits for the slot's lookup.
    # With WRITE, the step's own row of that block enters the tail's tile from its registers
    # (`step_row`, or -1 in the programs that do not hold it) and is stored into the slot at the
    # end: no store, barrier and load back on the way.
    tail_slot = -1
    tail_lo = last * BLOCK_SIZE
    pool_end = hi
    if TAIL_SLOTS:
        current_page = tl.load(table + current)
        tail_slot = tl.load(tail_of_ptr + current_page, mask=current_page < num_device_blocks, other=-1)
        pool_end = tl.where(tail_slot >= 0, tail_lo, hi)
        if WRITE:
            step_slot = tl.load(slot_ptr + seq).to(tl.int64)
            holds = (
                (step_slot >= 0) & (step_slot // BLOCK_SIZE == current_page) & (q_pos >= lo) & (q_pos < hi)
            )
            step_row = tl.where(holds, q_pos - tail_lo, -1)
            step_k = tl.load(
                new_k_ptr + seq * stride_nkt + kv_head * stride_nkh + dims, mask=dim_ok, other=0.0
            )
            step_v = tl.load(
                new_v_ptr + seq * stride_nvt + kv_head * stride_nvh + dims, mask=dim_ok, other=0.0
            )
        else:
            step_row, step_k, step_v = -1, q_ptr, q_ptr  # unread

    if WRITE:
        _store_step_kv(new_k_ptr, new_v_ptr, slot_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, summary_ptr, seq, kv_head,
                       q_pos, lo, hi, dims, dim_ok, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_c_block,
                       stride_c_off, stride_c_head, num_kv_heads, stride_sum_side, stride_sum_block, head_dim,
                       BLOCK_SIZE, SCALED, INT8, SUMMARY)  # fmt: skip

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    # Two pipeline stages, not the launch's default three: with Triton 3.6 for sm_90 the split kernel
    # then needs 128 registers a thread instead of 136, so four programs fit an SM instead of three.
    # On an H200 the engine's decode step ran 0.2-1.1% faster at batches 1-16 and at 256
    # (docs/benchmarks/2026-12-01-decode-stages-and-early-inputs-h200.md).
    # With TAIL_N, whole tiles of BLOCK_N keys, then the rest in tiles of TAIL_N: a context that ends
    # just past a whole tile does not pay for a mostly empty one. The whole tiles' end is a multiple
    # of BLOCK_N past `lo` (itself one), which Triton's analysis sees: their masks are uniform over
    # runs of positions, so the scales' loads (a page's run) can be vector loads rather than one a
    # token; the likely reason whole contexts ran faster this way too (FP8_HALF_TAIL).
    whole_end = hi if TAIL_N == 0 else lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    if SCALE_AHEAD:  # the first tile's scales, before the loop (see FP8_SCALES_AHEAD)
        pos, in_ctx, page = _tile_pages(lo, whole_end, table, chosen_row, chosen_len, last, current, hot_row,
                                        num_device_blocks, BLOCK_N, BLOCK_SIZE, SELECT, HOT)  # fmt: skip
        next_k_scale, next_v_scale = _tile_scales(ks_ptr, vs_ptr, hks_ptr, hvs_ptr, page, pos, in_ctx, kv_head,
                                                  num_kv_heads, num_device_blocks, stride_hs_block, BLOCK_SIZE,
                                                  HOST)  # fmt: skip
    for start in tl.range(lo, whole_end, BLOCK_N, num_stages=2):
        pos, in_ctx, page = _tile_pages(start, whole_end, table, chosen_row, chosen_len, last, current, hot_row,
                                        num_device_blocks, BLOCK_N, BLOCK_SIZE, SELECT, HOT)  # fmt: skip
        k_scale, v_scale = 1.0, 1.0  # unread without an 8-bit cache
        if SCALE_AHEAD:
            # This tile's scales came a tile ago; the next tile's are loaded now, their latency
            # hidden behind this tile's products.
            k_scale, v_scale = next_k_scale, next_v_scale
            ahead, ahead_in_ctx, ahead_page = _tile_pages(start + BLOCK_N, whole_end, table, chosen_row, chosen_len,
                                                          last, current, hot_row, num_device_blocks, BLOCK_N,
                                                          BLOCK_SIZE, SELECT, HOT)  # fmt: skip
            next_k_scale, next_v_scale = _tile_scales(ks_ptr, vs_ptr, hks_ptr, hvs_ptr, ahead_page, ahead,
                                                      ahead_in_ctx, kv_head, num_kv_heads, num_device_blocks,
                                                      stride_hs_block, BLOCK_SIZE, HOST)  # fmt: skip
        elif SCALED:  # fp8 in the cache, one float32 scale a (token, KV head)
            k_scale, v_scale = _tile_scales(ks_ptr, vs_ptr, hks_ptr, hvs_ptr, page, pos, in_ctx, kv_head, num_kv_heads,
                                            num_device_blocks, stride_hs_block, BLOCK_SIZE, HOST)  # fmt: skip
        acc, m_i, l_i = _attend_pages(acc, m_i, l_i, q, pos, in_ctx, page, k_scale, v_scale, first, dims, dim_ok,
                                      k_ptr, v_ptr, hk_ptr, hv_ptr, kv_head, num_device_blocks, stride_c_block,
                                      stride_h_block, stride_c_off, stride_c_head, sm_scale, softcap, pool_end,
                                      BLOCK_SIZE, USE_SOFTCAP, PRECISION, SCALED, F16_PRODUCTS, HOST,
                                      TAIL_SLOTS)  # fmt: skip
    if TAIL_N > 0:  # (names of their own: Triton keeps a name's shape across the loops)
        for half_start in tl.range(whole_end, hi, TAIL_N):
            half_pos, half_in_ctx, half_page = _tile_pages(half_start, hi, table, chosen_row, chosen_len, last,
                                                           current, hot_row, num_device_blocks, TAIL_N, BLOCK_SIZE,
                                                           SELECT, HOT)  # fmt: skip
            half_k_scale, half_v_scale = 1.0, 1.0
            if SCALED:
                half_k_scale, half_v_scale = _tile_scales(ks_ptr, vs_ptr, hks_ptr, hvs_ptr, half_page, half_pos,
                                                          half_in_ctx, kv_head, num_kv_heads, num_device_blocks,
                                                          stride_hs_block, BLOCK_SIZE, HOST)  # fmt: skip
            acc, m_i, l_i = _attend_pages(acc, m_i, l_i, q, half_pos, half_in_ctx, half_page, half_k_scale,
                                          half_v_scale, first, dims, dim_ok, k_ptr, v_ptr, hk_ptr, hv_ptr, kv_head,
                                          num_device_blocks, stride_c_block, stride_h_block, stride_c_off,
                                          stride_c_head, sm_scale, softcap, pool_end, BLOCK_SIZE, USE_SOFTCAP,
                                          PRECISION, SCALED, F16_PRODUCTS, HOST, TAIL_SLOTS)  # fmt: skip
    if TAIL_SLOTS:
        if (tail_slot >= 0) & (hi > tail_lo):
            acc, m_i, l_i = _attend_tail(acc, m_i, l_i, q, tail_ptr, tail_slot, tail_lo, lo, hi, first, kv_head,
                                         dims, dim_ok, stride_t_kv, stride_t_slot, stride_t_off, stride_t_head,
                                         step_row, step_k, step_v, sm_scale, softcap, BLOCK_SIZE, TAIL_TILE,
                                         USE_SOFTCAP, PRECISION, F16_PRODUCTS, WRITE)  # fmt: skip
        if WRITE:  # the step's row into its block's slot, for the steps after this one
            at = (
                tail_ptr
                + tl.maximum(tail_slot, 0).to(tl.int64) * stride_t_slot
                + tl.maximum(step_row, 0) * stride_t_off
            )
            at = at + kv_head * stride_t_head + dims
            # (A vector of the condition: Triton 3.6's interpreter takes no scalar-and-vector mask.)
            stored = dim_ok & (dims * 0 + tl.minimum(step_row, tail_slot) >= 0)
            tl.store(at, step_k.to(tail_ptr.dtype.element_ty), mask=stored)
            tl.store(at + stride_t_kv, step_v.to(tail_ptr.dtype.element_ty), mask=stored)

    if F16_PRODUCTS:
        acc = acc * (1.0 / V_WEIGHT)  # a power of two: exact
    if SPLIT:
        # Every split stores, an empty one (past a short context or before the window) included:
        # m = -inf, l = 0, acc = 0 weigh nothing in the merge, and its count keeps the total exact.
        seq_slot0 = seq * (group * tl.num_programs(1))
        slot = (seq_slot0 + heads) * num_splits + split
        tl.store(part_o_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + slot * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=row_ok)
        # A scalar atomic is issued by one thread and releases only what that thread ordered: the
        # barrier puts every thread's stores before it (Triton adds none; see triton-lang#6307).
        # Its result reaches the other threads through shared memory behind a barrier, which
        # carries the acquire over to their loads of the partials.
        tl.debug_barrier()
        counter = counters_ptr + seq * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            # Only the splits holding some of this sequence's context have anything to merge.
            used = tl.where(partition > 0, tl.cdiv(ctx, tl.maximum(partition, 1)), 0)
            merge_splits(part_o_ptr, part_ml_ptr, out_ptr, seq, kv_head * group, seq_slot0, stride_os, stride_oh,
                         group, head_dim, num_splits, used, sinks_ptr, BLOCK_S, BLOCK_D, MERGE_ROWS, SINKS)  # fmt: skip
            # Back to zero for the next launch (and every graph replay) without a memset kernel;
            # nothing else touches this counter until this kernel has finished.
            tl.store(counter, 0)
    else:
        if SINKS:  # each head's learned sink, one more key of zero value
            acc, l_i = fold_sink(acc, m_i, l_i, tl.load(sinks_ptr + heads, mask=row_ok, other=0.0))
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _attend_pages(acc, m_i, l_i, q, pos, in_ctx, page, k_scale, v_scale, first, dims, dim_ok, k_ptr, v_ptr, hk_ptr,
                  hv_ptr, kv_head, num_device_blocks, stride_c_block, stride_h_block, stride_c_off, stride_c_head,
                  sm_scale, softcap, pool_end, BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                  PRECISION: tl.constexpr, SCALED: tl.constexpr, F16_PRODUCTS: tl.constexpr, HOST: tl.constexpr,
                  TAIL_SLOTS: tl.constexpr):  # fmt: skip
    """Fold one tile's keys and values (positions `pos` on pages `page`) into the running softmax;
    with TAIL_SLOTS, only those before `pool_end` (the current block is then read from its slot)."""
    # Pages past the device pool's (HOST) are host blocks, read where they lie.
    within = (pos % BLOCK_SIZE) * stride_c_off + kv_head * stride_c_head
    k_at = block_address(k_ptr, hk_ptr, page, num_device_blocks, stride_c_block, stride_h_block, within, HOST)
    v_at = block_address(v_ptr, hv_ptr, page, num_device_blocks, stride_c_block, stride_h_block, within, HOST)
    k_at, v_at = k_at[:, None] + dims[None, :], v_at[:, None] + dims[None, :]
    kv_mask = in_ctx[:, None] & dim_ok[None, :]
    k = tl.load(k_at, mask=kv_mask, other=0.0)
    v = tl.load(v_at, mask=kv_mask, other=0.0)
    mask = in_ctx & (pos >= first)
    if TAIL_SLOTS:
        mask = mask & (pos < pool_end)
    if F16_PRODUCTS:
        # e4m3 widens to f16 exactly, two values an instruction: keys and values enter the
        # products as stored, the keys' scales multiply the scores and the values' scales the
        # probabilities ([rows, tile] each, not [tile, head_dim]). The weights carry the
        # values' scales times V_WEIGHT, keeping them in f16's normal range as values of
        # magnitude ~1 keep them; the sum is divided by it once at the end.
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, widen_f16(k), widen_f16(v), mask[None, :], sm_scale,
                                    softcap, USE_SOFTCAP, PRECISION, k_scale=k_scale,
                                    v_scale=v_scale * V_WEIGHT)  # fmt: skip
    else:
        if SCALED:  # a float32 query: dequantized to its dtype
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, mask[None, :], sm_scale, softcap, USE_SOFTCAP, PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def _attend_tail(acc, m_i, l_i, q, tail_ptr, tail_slot, tail_lo, lo, hi, first, kv_head, dims, dim_ok, stride_t_kv,
                 stride_t_slot, stride_t_off, stride_t_head, step_row, step_k, step_v, sm_scale, softcap,
                 BLOCK_SIZE: tl.constexpr, TAIL_TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 PRECISION: tl.constexpr, F16_PRODUCTS: tl.constexpr, STEP_ROW: tl.constexpr):  # fmt: skip
    """Fold the current block's rows held in its tail slot (positions from `tail_lo`, those of
    this program's range [lo, hi)) into the running softmax: keys and values in the model's dtype.
    With STEP_ROW, row `step_row` (if >= 0) is this step's, taken from `step_k` and `step_v`."""
    row = tl.arange(0, TAIL_TILE)
    pos = tail_lo + row
    in_ctx = (row < BLOCK_SIZE) & (pos >= lo) & (pos < hi)
    at = tail_ptr + tail_slot.to(tl.int64) * stride_t_slot + row * stride_t_off + kv_head * stride_t_head
    stored = in_ctx
    if STEP_ROW:
        stored = stored & (row != step_row)
    kv_mask = stored[:, None] & dim_ok[None, :]
    k = tl.load(at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(at[:, None] + stride_t_kv + dims[None, :], mask=kv_mask, other=0.0)
    if STEP_ROW:
        mine = (row == step_row)[:, None]
        k = tl.where(mine, step_k[None, :].to(k.dtype), k)
        v = tl.where(mine, step_v[None, :].to(v.dtype), v)
    mask = in_ctx & (pos >= first)
    if F16_PRODUCTS:  # the pool's products' form: f16 operands, values weighted by V_WEIGHT
        ones = tl.full([TAIL_TILE], 1.0, tl.float32)
        return attend_tile(acc, m_i, l_i, q, k.to(tl.float16), v.to(tl.float16), mask[None, :], sm_scale, softcap,
                           USE_SOFTCAP, PRECISION, k_scale=ones, v_scale=ones * V_WEIGHT)  # fmt: skip
    return attend_tile(acc, m_i, l_i, q, k.to(q.dtype), v.to(q.dtype), mask[None, :], sm_scale, softcap,
                       USE_SOFTCAP, PRECISION)  # fmt: skip


@triton.jit
def _tile_pages(start, hi, table, chosen_row, chosen_len, last, current, hot_row, num_device_blocks,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SELECT: tl.constexpr, HOT: tl.constexpr):  # fmt: skip
    """The tile from `start`: its positions in the context read, which are in it (< hi), and the
    page of each (a per-token block-table lookup: tiles may span several pages of any size). With
    HOT, a host page this KV head has in the hot-block cache (`hot_row`, by host block: a device
    block or -1) is read from that device block instead."""
    pos = start + tl.arange(0, BLOCK_N)
    in_ctx = pos < hi
    column = pos // BLOCK_SIZE
    if SELECT:  # through the chosen blocks' columns, and the current block's last
        # (A tensor, not the scalar: Triton 3.6's interpreter takes no scalar-and-vector mask.)
        through = column * 0 + chosen_len > 0
        chosen = through & (column < last)
        mapped = tl.load(chosen_row + column, mask=in_ctx & chosen, other=0)
        column = tl.where(chosen, mapped, tl.where(through, current, column))
    page = tl.load(table + column, mask=in_ctx, other=0).to(tl.int64)
    if HOT:
        away = in_ctx & (page >= num_device_blocks)
        cached = tl.load(hot_row + tl.where(away, page - num_device_blocks, 0), mask=away, other=-1)
        page = tl.where(cached >= 0, cached.to(tl.int64), page)
    return pos, in_ctx, page


@triton.jit
def _tile_scales(ks_ptr, vs_ptr, hks_ptr, hvs_ptr, page, pos, in_ctx, kv_head, num_kv_heads, num_device_blocks,
                 stride_hs_block, BLOCK_SIZE: tl.constexpr, HOST: tl.constexpr):  # fmt: skip
    """An fp8 tile's key and value scales, one float32 a (token, KV head): stored [2, blocks, KV
    heads, BLOCK_SIZE], so a page's scales of this head are one contiguous run."""
    run, page_run = kv_head * BLOCK_SIZE + pos % BLOCK_SIZE, num_kv_heads * BLOCK_SIZE
    ks_at = block_address(ks_ptr, hks_ptr, page, num_device_blocks, page_run, stride_hs_block, run, HOST)
    vs_at = block_address(vs_ptr, hvs_ptr, page, num_device_blocks, page_run, stride_hs_block, run, HOST)
    return tl.load(ks_at, mask=in_ctx, other=0.0), tl.load(vs_at, mask=in_ctx, other=0.0)


@triton.jit
def _store_step_kv(new_k_ptr, new_v_ptr, slot_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, summary_ptr, seq, kv_head, q_pos,
                   lo, hi, dims, dim_ok, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_c_block, stride_c_off,
                   stride_c_head, num_kv_heads, stride_sum_side, stride_sum_block, head_dim,
                   BLOCK_SIZE: tl.constexpr, SCALED: tl.constexpr, INT8: tl.constexpr,
                   SUMMARY: tl.constexpr):  # fmt: skip
    """This step's key and value of one (sequence, KV head) into the cache, in place of a launch of
    their own: the program whose context range holds the query's position stores them and then
    reads them back with its tiles; no other program reads that position. Slot -1 (padding) is
    skipped. The barrier puts every thread's store before any thread's load of the same row (a CTA
    barrier orders global memory within the block). Into an 8-bit cache the rows are quantized as
    `kv_write` quantizes them, their scales stored beside them. With SUMMARY, the key is folded into
    its block's minimum and maximum (`reference.update_key_summaries`): a block's first slot
    starts them over."""
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if (slot >= 0) & (q_pos >= lo) & (q_pos < hi):
        dst = (
            (slot // BLOCK_SIZE) * stride_c_block
            + (slot % BLOCK_SIZE) * stride_c_off
            + kv_head * stride_c_head
        )
        k = tl.load(new_k_ptr + seq * stride_nkt + kv_head * stride_nkh + dims, mask=dim_ok, other=0.0)
        v = tl.load(new_v_ptr + seq * stride_nvt + kv_head * stride_nvh + dims, mask=dim_ok, other=0.0)
        if SUMMARY:
            at = summary_ptr + (slot // BLOCK_SIZE) * stride_sum_block + kv_head * head_dim + dims
            key = k.to(summary_ptr.dtype.element_ty)
            starts = (slot % BLOCK_SIZE) == 0
            low = tl.where(starts, key, tl.minimum(tl.load(at, mask=dim_ok, other=0.0), key))
            high = tl.where(
                starts, key, tl.maximum(tl.load(at + stride_sum_side, mask=dim_ok, other=0.0), key)
            )
            tl.store(at, low, mask=dim_ok)
            tl.store(at + stride_sum_side, high, mask=dim_ok)
        if SCALED:
            k_rows, k_scale = scaled_kv_rows(k.to(tl.float32)[None, :], INT8)
            v_rows, v_scale = scaled_kv_rows(v.to(tl.float32)[None, :], INT8)
            one = tl.arange(0, 1)
            scale_at = ((slot // BLOCK_SIZE) * num_kv_heads + kv_head) * BLOCK_SIZE + slot % BLOCK_SIZE
            tl.store(ks_ptr + scale_at + one, k_scale)
            tl.store(vs_ptr + scale_at + one, v_scale)
            k, v = tl.reshape(k_rows, (k.shape[0],)), tl.reshape(v_rows, (v.shape[0],))
        tl.store(k_ptr + dst + dims, k.to(k_ptr.dtype.element_ty), mask=dim_ok)
        tl.store(v_ptr + dst + dims, v.to(v_ptr.dtype.element_ty), mask=dim_ok)
    tl.debug_barrier()


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs], including this step's token
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    step_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kv_scale: torch.Tensor | None = None,
    selection: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_summary: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    sinks: torch.Tensor | None = None,
    hot: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache; returns (or fills) out [num_seqs, num_heads, head_dim].

    max_seq_len is a host-side bound on seq_lens used to size the context splits (default: the
    capacity of the block table, which keeps the launch shape-only for CUDA graphs). step_kv: this
    step's (key, value [num_seqs, num_kv_heads, head_dim], slot_mapping [num_seqs]) not yet in the
    cache; the kernel stores them (as `kv_write.write_kv` would) before it reads them. kv_scale
    [2, num_blocks, num_kv_heads, block_size] float32, contiguous: the cache is fp8 with these scales.
    selection: (chosen [num_seqs, num_kv_heads, k - 1] block-table columns, lengths [num_seqs]) from
    `decode_selection`: a sequence of length > 0 attends over its chosen blocks and its current one. key_summary
    [2, num_blocks, num_kv_heads, head_dim], contiguous: the step's keys are folded into it as
    they are stored.
    host: (host_cache [2, host_blocks, block_size, num_kv_heads, head_dim], its scales [2,
    host_blocks, num_kv_heads, block_size] or None, first), strided by host block
    (`HostKVPool.layer_views`; pinned host memory on CUDA): block-table entries at or past `first`
    (the pool's block count, scratch blocks aside) name host block entry - first, read in place. The
    step's own slot is in the device pool.
    sinks: float32 [num_heads], learned per-head sink logits (a key of zero value in every row).
    hot: int32 [num_kv_heads, >= host_blocks], with `host` and `selection`: per KV head, the device
    block holding that head of each host block (the hot-block cache, `server/kv_cache/hot_blocks.py`)
    or -1; the chosen host blocks it holds are read there instead of over the link.
    tail: with kv_scale, (tail cache [2, slots, block_size, num_kv_heads, head_dim] in the model's
    dtype, slot_of int32 [num_blocks]): a current block with a slot is read from it, and the step's
    rows of blocks with a slot are stored there too (`server/kv_cache/tail_blocks.py`).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and out.stride(2) == 1
    block_n, num_warps = launch_tile(
        num_seqs, num_kv_heads, kv_scale is not None, step_kv is not None, block_n
    )
    max_context = max_seq_len or block_tables.shape[1] * block_size
    splits = num_splits or choose_splits(num_seqs, num_kv_heads, max_context, block_n)
    block_d = triton.next_power_of_2(head_dim)
    # Unused placeholders when there is a single split (and constexprs that compile no variants).
    part_o, part_ml, counters, block_s, merge_rows = out, out, seq_lens, 1, 1
    if splits > 1:
        part_o = torch.empty(num_seqs * num_heads * splits, block_d, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_seqs * num_heads * splits, 2, dtype=torch.float32, device=query.device)
        counters = split_counters(query.device, num_seqs * num_kv_heads)
        merge_rows, block_s = merge_tile(group, block_d)
    new_k, new_v, slots = step_kv or (query, query, seq_lens)  # unused placeholders without WRITE
    assert new_k.stride(2) == 1 and new_v.stride(2) == 1
    assert kv_scale is None or kv_scale.is_contiguous()
    scales = (kv_cache, kv_cache) if kv_scale is None else (kv_scale[0], kv_scale[1])  # unread unscaled
    chosen, chosen_lens = selection or (block_tables[:, None, :], seq_lens)  # unread without SELECT
    assert key_summary is None or key_summary.is_contiguous()
    summary = kv_cache if key_summary is None else key_summary  # unread without SUMMARY
    host_cache, host_scale, first_host_id = host or (kv_cache, None, kv_cache.shape[1])  # unread without HOST
    assert host_cache.stride()[2:] == kv_cache.stride()[2:] and host_cache.dtype == kv_cache.dtype
    host_scales = scales if host_scale is None else (host_scale[0], host_scale[1])
    assert host_scale is None or host_scale.stride()[2:] == kv_scale.stride()[2:]
    assert (host_scale is None) == (kv_scale is None or host is None)
    assert hot is None or (host is not None and selection is not None and hot.stride(1) == 1)
    hot_map = seq_lens if hot is None else hot  # unread without HOT
    assert tail is None or kv_scale is not None
    tail_cache, tail_of = tail or (kv_cache, seq_lens)  # unread without TAIL_SLOTS
    assert tail_cache.stride(4) == 1
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, kv_cache[0], kv_cache[1], *scales, block_tables, seq_lens, out, part_o, part_ml, counters,
        new_k, new_v, slots, chosen, chosen_lens, summary, chosen.stride(0), chosen.stride(1),
        summary.stride(0), summary.stride(1),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        scale, softcap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), num_kv_heads,
        block_tables.stride(0),
        group, head_dim, splits,
        host_cache[0], host_cache[1], *host_scales, first_host_id, host_cache.stride(1),
        host_scales[0].stride(0), seq_lens if sinks is None else sinks.float().contiguous(),
        hot_map, hot_map.stride(0), tail_cache, tail_of, *tail_cache.stride()[:4],
        BLOCK_SIZE=block_size, BLOCK_G=pow2(group), BLOCK_D=block_d, BLOCK_N=block_n,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        SPLIT=splits > 1, PRECISION=dot_precision(query.dtype),
        BLOCK_S=block_s, MERGE_ROWS=merge_rows, WRITE=step_kv is not None, SCALED=kv_scale is not None,
        INT8=kv_cache.dtype == torch.int8,
        SELECT=selection is not None, SUMMARY=step_kv is not None and key_summary is not None,
        F16_PRODUCTS=kv_scale is not None and query.dtype != torch.float32,
        HOST=host is not None, SCALE_AHEAD=kv_scale is not None and FP8_SCALES_AHEAD,
        TAIL_N=block_n // 2 if kv_scale is not None and FP8_HALF_TAIL else 0, SINKS=sinks is not None,
        HOT=hot is not None, TAIL_SLOTS=tail is not None, TAIL_TILE=max(16, pow2(block_size)),
        num_warps=num_warps, **pdl(query),
    )  # fmt: skip
    return out
