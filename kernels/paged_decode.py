"""Triton paged decode attention: one query token per sequence against its paged KV.

Twin: `reference.paged_attention` with one query per sequence.

Grouped-query natively: a program owns one KV head of one sequence and all the query heads that
share it (padded to 16 rows for tl.dot), so each key/value is read from HBM once per group, never
repeated. Long contexts with few sequences are split along the context (flash-decoding): each
split writes an unnormalised partial output plus its running max and sum, and a second small
kernel merges them. The grid depends only on tensor shapes, so it can be captured in a CUDA graph;
each sequence divides its own context among the splits, so a graph sized for long contexts still
spreads a short one over many programs instead of leaving it to a few.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import attend_tile, dot_precision, interpreting, pow2


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
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
    stride_bt,
    group,
    head_dim,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq)
    q_pos = ctx - 1

    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group + rows
    row_ok = rows < group
    dim_ok = dims < head_dim
    row_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=row_mask, other=0.0
    )

    # This sequence's context in num_splits whole tiles' worth each: splits past its end have nothing.
    partition = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * partition
    hi = tl.minimum(lo + partition, ctx)
    first = 0
    if USE_WINDOW:
        first = q_pos - window + 1
        # Tiles wholly before the window are skipped; start stays BLOCK_N-aligned.
        lo = tl.maximum(lo, (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    table = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_ctx = pos < hi
        # Per-token block-table lookup: tiles may span several pages of any size.
        page = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        base = page * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off + kv_head * stride_c_head
        kv_mask = in_ctx[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        mask = in_ctx & (pos >= first)
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, mask[None, :], sm_scale, softcap,
                                    USE_SOFTCAP, PRECISION)  # fmt: skip

    if SPLIT:
        slot = (seq * (group * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_o_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + slot * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _merge_kernel(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine the splits of one (sequence, head): weights 2^(m_s - max) rescale each partial."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    ok = splits < num_splits
    slot = (seq * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + slot * 2, mask=ok, other=float("-inf"))
    ll = tl.load(part_ml_ptr + slot * 2 + 1, mask=ok, other=0.0)
    o = tl.load(part_o_ptr + slot[:, None] * BLOCK_D + dims[None, :], mask=ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * ll, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    out_ptrs = out_ptr + seq * stride_os + head * stride_oh + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def choose_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int) -> int:
    """Enough context splits to give the GPU about two programs per SM, none shorter than 4 tiles."""
    if interpreting() or not torch.cuda.is_available():
        return 1
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    want = triton.cdiv(2 * sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context, 4 * block_n), 64))


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
) -> torch.Tensor:
    """Decode attention over the paged cache; returns (or fills) out [num_seqs, num_heads, head_dim].

    max_seq_len is a host-side bound on seq_lens used to size the context splits (default: the
    capacity of the block table, which keeps the launch shape-only for CUDA graphs).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and out.stride(2) == 1
    block_n = block_n or (16 if interpreting() else 64)
    max_context = max_seq_len or block_tables.shape[1] * block_size
    splits = num_splits or choose_splits(num_seqs, num_kv_heads, max_context, block_n)
    block_d = triton.next_power_of_2(head_dim)
    part_o = part_ml = out  # unused placeholders when there is a single split
    if splits > 1:
        part_o = torch.empty(num_seqs * num_heads * splits, block_d, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_seqs * num_heads * splits, 2, dtype=torch.float32, device=query.device)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, kv_cache[0], kv_cache[1], block_tables, seq_lens, out, part_o, part_ml,
        scale, softcap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        group, head_dim, splits,
        BLOCK_SIZE=block_size, BLOCK_G=pow2(group), BLOCK_D=block_d, BLOCK_N=block_n,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        SPLIT=splits > 1, PRECISION=dot_precision(query.dtype),
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part_o, part_ml, out, out.stride(0), out.stride(1), num_heads, head_dim, splits,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out
