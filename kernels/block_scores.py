"""Triton scores of a decode query against every block's key summary, and the exact scores of the
best-bounded candidates (selective decode attention, `decode_selection.py`).

Twins: `reference.block_scores`, `reference.candidate_scores`. A bound program owns one KV head of
one sequence and BLOCK_J of its blocks: it reads each block's key minimum and maximum once for all
the query heads that share the KV head, so a step reads the summaries once (at a million tokens of
Llama-3-8B, 8 GiB across the layers, against 64 GiB of fp8 keys and values). The bound is two
products, max(q, 0) . maximum and min(q, 0) . minimum, on the tensor cores. A candidate program
reads the keys of BLOCK_C candidate blocks and takes their largest logit over the group's heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import block_address, dot_precision, interpreting, pow2


@triton.jit
def _group_query(q_ptr, seq, kv_head, stride_qs, stride_qh, group, head_dim, BLOCK_G: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
    """The decode queries of the heads that share one KV head, [BLOCK_G, BLOCK_D] (rows past the
    group and dims past head_dim are 0), with the row and dim masks and the dims."""
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < group
    dim_ok = dims < head_dim
    q_ptrs = q_ptr + seq * stride_qs + (kv_head * group + rows)[:, None] * stride_qh + dims[None, :]
    return tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0), row_ok, dims, dim_ok


@triton.jit
def _block_scores_kernel(
    q_ptr,
    summary_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qs,
    stride_qh,
    stride_side,
    stride_block,
    stride_head,
    stride_bt,
    stride_os,
    stride_oh,
    group,
    head_dim,
    width,
    sink_blocks,
    recent_blocks,
    host_summary_ptr,
    first_host,
    stride_h_side,
    stride_h_block,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_J: tl.constexpr,
    PRECISION: tl.constexpr,
    HOST: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    blocks = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    num_blocks = tl.cdiv(tl.load(seq_lens_ptr + seq), BLOCK_SIZE)
    in_ctx = blocks < num_blocks

    q, row_ok, dims, dim_ok = _group_query(q_ptr, seq, kv_head, stride_qs, stride_qh, group, head_dim, BLOCK_G,
                                           BLOCK_D)  # fmt: skip

    page = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + blocks, mask=in_ctx, other=0).to(tl.int64)
    within = kv_head * stride_head  # of a host block (HOST) where the long-context tier spilled it
    low_at = block_address(summary_ptr, host_summary_ptr, page, first_host, stride_block, stride_h_block, within,
                           HOST)  # fmt: skip
    high_at = block_address(summary_ptr + stride_side, host_summary_ptr + stride_h_side, page, first_host,
                            stride_block, stride_h_block, within, HOST)  # fmt: skip
    mask = in_ctx[:, None] & dim_ok[None, :]
    low = tl.load(low_at[:, None] + dims[None, :], mask=mask, other=0.0)
    high = tl.load(high_at[:, None] + dims[None, :], mask=mask, other=0.0)
    # max(q lo, q hi) = max(q, 0) hi + min(q, 0) lo: the summaries go to the tensor cores as loaded.
    # (Cast back: with the scalar, Triton computes in float32 on a GPU, and tl.dot takes one dtype.)
    bound = tl.dot(tl.maximum(q, 0.0).to(high.dtype), tl.trans(high), input_precision=PRECISION)
    bound += tl.dot(tl.minimum(q, 0.0).to(low.dtype), tl.trans(low), input_precision=PRECISION)
    best = tl.max(tl.where(row_ok[:, None], bound, float("-inf")), 0)

    forced = (blocks < sink_blocks) | (blocks >= num_blocks - recent_blocks)
    score = tl.where(forced, float("inf"), best)
    # The current block is always read, after the chosen ones: it takes no place among them.
    score = tl.where(blocks < num_blocks - 1, score, float("-inf"))
    tl.store(out_ptr + seq * stride_os + kv_head * stride_oh + blocks, score, mask=blocks < width)


def block_scores(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_summary: torch.Tensor,  # [2, num_blocks, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_size: int,
    sink_blocks: int,
    recent_blocks: int,
    block_j: int | None = None,
    num_warps: int = 4,
    host_summary: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:  # float32 [num_seqs, num_kv_heads, width]
    """Every block's score for the query, per KV head (`reference.block_scores`): one launch whose
    grid depends only on shapes, so a CUDA graph captures it. block_j (blocks a program) and
    num_warps are the launch's tiles, for the benchmark's sweep. host_summary: (the host blocks'
    summaries [2, host_blocks, num_kv_heads, head_dim], strided by block; the first host id)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, width = key_summary.shape[2], block_tables.shape[1]
    assert query.stride(2) == 1 and key_summary.stride(3) == 1 and block_tables.stride(1) == 1
    out = torch.empty(num_seqs, num_kv_heads, width, dtype=torch.float32, device=query.device)
    block_j = block_j or (16 if interpreting() else 64)
    group = num_heads // num_kv_heads
    host, first_host = host_summary or (key_summary, key_summary.shape[1])  # unread without HOST
    assert host.stride()[2:] == key_summary.stride()[2:]
    _block_scores_kernel[(num_seqs, num_kv_heads, triton.cdiv(width, block_j))](
        query, key_summary, block_tables, seq_lens, out,
        query.stride(0), query.stride(1),
        key_summary.stride(0), key_summary.stride(1), key_summary.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        group, head_dim, width, sink_blocks, recent_blocks, host, first_host, host.stride(0), host.stride(1),
        BLOCK_SIZE=block_size, BLOCK_G=pow2(group), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_J=block_j, PRECISION=dot_precision(query.dtype), HOST=host_summary is not None, num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _candidate_scores_kernel(
    q_ptr,
    k_ptr,
    ks_ptr,
    bt_ptr,
    cand_ptr,
    bound_ptr,
    out_ptr,
    stride_qs,
    stride_qh,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_bt,
    stride_cs,
    stride_ch,
    stride_bs,
    stride_bh,
    stride_os,
    stride_oh,
    num_kv_heads,
    group,
    head_dim,
    num_candidates,
    hk_ptr,
    hks_ptr,
    first_host,
    stride_h_block,
    stride_hs_block,
    copy_k_ptr,
    copy_s_ptr,
    slot_ptr,
    stride_copy_block,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
    HOST: tl.constexpr = False,
    COPIED: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_C
    cand_row = cand_ptr + seq.to(tl.int64) * stride_cs + kv_head * stride_ch
    table = bt_ptr + seq.to(tl.int64) * stride_bt

    q, row_ok, dims, dim_ok = _group_query(q_ptr, seq, kv_head, stride_qs, stride_qh, group, head_dim, BLOCK_G,
                                           BLOCK_D)  # fmt: skip

    # Every key of the program's BLOCK_C candidate blocks, a block's BLOCK_SIZE tokens in a row.
    tokens = tl.arange(0, BLOCK_C * BLOCK_SIZE)
    which = first + tokens // BLOCK_SIZE
    token_ok = which < num_candidates
    column = tl.load(cand_row + which, mask=token_ok, other=0)
    page = tl.load(table + column, mask=token_ok, other=0).to(tl.int64)
    offset = tokens % BLOCK_SIZE
    within = offset * stride_c_off + kv_head * stride_c_head  # host blocks (HOST) read in place
    k_at = block_address(k_ptr, hk_ptr, page, first_host, stride_c_block, stride_h_block, within, HOST)
    run, page_run = kv_head * BLOCK_SIZE + offset, num_kv_heads * BLOCK_SIZE
    read = token_ok
    if COPIED:  # host blocks with a key copy on the device (`HostKeyCopies`) read it, not the link
        on_host = token_ok & (page >= first_host)
        slot = tl.load(slot_ptr + tl.maximum(page - first_host, 0), mask=on_host, other=-1)
        copied = slot >= 0
        read = token_ok & ~copied
    k = tl.load(k_at[:, None] + dims[None, :], mask=read[:, None] & dim_ok[None, :], other=0.0)
    if SCALED:  # an 8-bit cache: dequantized to the query's dtype (decode multiplies in f16 instead)
        ks_at = block_address(ks_ptr, hks_ptr, page, first_host, page_run, stride_hs_block, run, HOST)
        k_scale = tl.load(ks_at, mask=read, other=0.0)
        k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
    if COPIED:
        copy_at = slot.to(tl.int64) * stride_copy_block + offset * stride_c_off + kv_head * stride_c_head
        copy_k = tl.load(copy_k_ptr + copy_at[:, None] + dims[None, :], mask=copied[:, None] & dim_ok[None, :],
                         other=0.0)  # fmt: skip
        copy_scale = tl.load(copy_s_ptr + slot.to(tl.int64) * page_run + run, mask=copied, other=0.0)
        copy_k = (copy_k.to(tl.float32) * copy_scale[:, None]).to(q.dtype)
        k = tl.where(copied[:, None], copy_k, k.to(q.dtype))
    logits = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_G, tokens]
    per_token = tl.max(tl.where(row_ok[:, None], logits, float("-inf")), 0)
    per_block = tl.max(tl.reshape(per_token, (BLOCK_C, BLOCK_SIZE)), 1)

    cands = first + tl.arange(0, BLOCK_C)
    cand_ok = cands < num_candidates
    cand_column = tl.load(cand_row + cands, mask=cand_ok, other=0)
    given = tl.load(bound_ptr + seq.to(tl.int64) * stride_bs + kv_head * stride_bh + cand_column, mask=cand_ok,
                    other=0.0)  # fmt: skip
    # The sink's and the recent window's (+inf) and the current block's and past the context (-inf) stay.
    infinite = (given == float("inf")) | (given == float("-inf"))
    score = tl.where(infinite, given, per_block)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + kv_head * stride_oh + cands, score, mask=cand_ok)


def candidate_scores(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    candidates: torch.Tensor,  # int64 [num_seqs, num_kv_heads, c]: block-table columns
    bound: torch.Tensor,  # float32 [num_seqs, num_kv_heads, width]
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    key_copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # float32 [num_seqs, num_kv_heads, c]
    """Each candidate block's largest true logit (`reference.candidate_scores`), read from the cache
    (host blocks as paged_decode's `host` names them, or from their device copies where `key_copy`,
    `LayerKeyCopy`'s (keys, scales, slot_of), has one): one launch whose grid depends only on shapes."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    count = candidates.shape[2]
    out = torch.empty(num_seqs, num_kv_heads, count, dtype=torch.float32, device=query.device)
    if count == 0:
        return out
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and candidates.stride(2) == 1
    assert bound.stride(2) == 1 and (kv_scale is None or kv_scale.is_contiguous())
    block_c = 2 if interpreting() else 8
    group = num_heads // num_kv_heads
    scales = kv_cache if kv_scale is None else kv_scale[0]  # unread unscaled
    host_cache, host_scale, first_host = host or (kv_cache, None, kv_cache.shape[1])  # unread without HOST
    assert host_cache.stride()[2:] == kv_cache.stride()[2:]
    host_scales = scales if host_scale is None else host_scale[0]
    copy_keys, copy_scales, slot_of = key_copy or (kv_cache[0], scales, block_tables)  # unread without COPIED
    assert key_copy is None or (host is not None and copy_keys.stride()[1:] == kv_cache.stride()[2:])
    _candidate_scores_kernel[(num_seqs, num_kv_heads, triton.cdiv(count, block_c))](
        query, kv_cache[0], scales, block_tables, candidates, bound, out,
        query.stride(0), query.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), candidates.stride(0), candidates.stride(1), bound.stride(0), bound.stride(1),
        out.stride(0), out.stride(1), num_kv_heads, group, head_dim, count,
        host_cache[0], host_scales, first_host, host_cache.stride(1), host_scales.stride(0),
        copy_keys, copy_scales, slot_of, copy_keys.stride(0),
        BLOCK_SIZE=block_size, BLOCK_G=pow2(group), BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_C=block_c,
        SCALED=kv_scale is not None, PRECISION=dot_precision(query.dtype), HOST=host is not None,
        COPIED=key_copy is not None,
    )  # fmt: skip
    return out
