"""Triton sparse causal prefill attention over a SparseIndex (MInference-style patterns).

Twin: `reference.masked_attention` under `index.index_to_mask(index)`.

One program per (query block, query head), the late query blocks (the most keys) first, in two
launches over the three disjoint sources of the index. The first walks the selected block diagonals
past the diagonal block (`index.diagonal_runs`: each run of consecutive offsets is a contiguous key
range, walked without a mask) and stores a partial output with each row's running max and sum. The
second continues from that state with the diagonal block (masked causally), the listed key blocks
and the gathered key columns (skipping columns that a walked block already holds), then stores the
final output. Split this way, the walk (most of the work) compiles to a plain flash loop, without
the registers and shared memory the other sources need. Heads of one layer may mix patterns
(A-shape, vertical-slash, block-sparse, dense) in a single launch. Grouped-query natively: a query
head reads the keys of head // group in place; KV is never repeated, except the column keys,
gathered per query head (a few thousand rows) so that their loads advance contiguously too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tgserve.kernels.sparse.index import SparseIndex, diagonal_runs
from tgserve.kernels.sparse.tail import Tail
from tgserve.kernels.triton_common import attend_tile, dot_precision, interpreting, launch_fitting, pow2

# Pass 2 (diagonal block, listed blocks, columns) at two stages: with three, H200 replays of 128K
# indices took 46-47 ms a layer against 38-39 at two. kernels/bench/replay_sparse.py times them.
# column_blocks: gathered key columns a step, in blocks. Replays of 128K indices on an H200, ms a
# layer: 2 (128 columns) 33.5-34.1, 1 (64) 35.6-36.3; two query blocks a program sharing the
# columns spill registers and lose (38-40).
# The columns stay here: in the walk's programs (8 warps, 248 registers already) a column loop
# spilled 14-20 registers and the layer lost 2.6-3.5 ms (2026-11-30 pass2-chunk-tests record).
LAUNCH = {"num_warps": 4, "num_stages": 2, "column_blocks": 2}
# The diagonal walk's own kernel: query blocks per program, key blocks per unmasked step, warps,
# pipeline stages. H200 replays of 128K indices (ms a layer): 2 / 2 / 8 / 3 36.8-37.8, with one key
# block a step 37.9-38.7 (2 stages 39.2-39.6; one query block 41.1-41.7, at 8 warps 54-57).
WALK_LAUNCH = {"qblocks": 2, "key_blocks": 2, "num_warps": 8, "num_stages": 3}
# Smaller launches for GPUs with less shared memory a block than the 224 KiB the walk's takes on an
# H200 (A100 163 KiB, Ada 99 KiB) or pass 2's 88 KiB: tried in order (triton_common.launch_fitting).
WALK_FALLBACKS = (
    {"qblocks": 1, "key_blocks": 1, "num_warps": 4, "num_stages": 3},
    {"qblocks": 1, "key_blocks": 1, "num_warps": 4, "num_stages": 1},
)
FALLBACKS = ({"num_warps": 4, "num_stages": 1, "column_blocks": 1},)
# Triton compiles an integer argument divisible by 16 into its own kernel: a prompt's length and
# block count would give a long prompt of a new kind (131,072 tokens against 130,944) its own
# compile on first use. These are not specialised: every length shares one kernel.
LENGTH_ARGS = ("n", "num_qb")
USE_DESCRIPTORS = True  # mask-free K/V loads through tensor descriptors where the layout allows
# Pass 2 tests up to this many column chunks for the mask-free step before its loop, as bits of one
# int32 (H200, 128K replays: pass 2 9.43 ms a layer against 9.85 testing each chunk in the loop).
CLEAN_BITS_CHUNKS = 31


@triton.jit
def _key_block(acc, m_i, l_i, q, rows, j, k_ptrs, v_ptrs, stride_kt, stride_vt, dim_ok, n, sm_scale,
               BLOCK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Fold the contiguous key block j into the running softmax, causally.

    k_ptrs / v_ptrs are the row-0 pointers of every head dimension ([1, BLOCK_D]).
    """
    pos = j * BLOCK + tl.arange(0, BLOCK)
    in_seq = pos < n
    kv_mask = in_seq[:, None] & dim_ok[None, :]
    pos64 = pos.to(tl.int64)[:, None]
    k = tl.load(k_ptrs + pos64 * stride_kt, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs + pos64 * stride_vt, mask=kv_mask, other=0.0)
    mask = (pos[None, :] <= rows[:, None]) & in_seq[None, :]
    return attend_tile(acc, m_i, l_i, q, k, v, mask, sm_scale, 0.0, False, PRECISION)


@triton.jit
def _inner_block(acc, m_i, l_i, q, first_key, k_ptrs, v_ptrs, stride_kt, stride_vt, dim_ok, sm_scale,
                 k_desc, v_desc, head_col, BLOCK: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                 DESC: tl.constexpr):  # fmt: skip
    """The BLOCK keys from first_key, wholly before the query block and inside the sequence: no mask.

    DESC: through tensor descriptors (TMA on Hopper) at (first_key, head_col) of the [n, heads x D] view.
    """
    pos64 = (first_key + tl.arange(0, BLOCK)).to(tl.int64)[:, None]
    if DESC:
        k = k_desc.load([first_key, head_col])
        v = v_desc.load([first_key, head_col])
    elif EVEN_D:
        k = tl.load(k_ptrs + pos64 * stride_kt)
        v = tl.load(v_ptrs + pos64 * stride_vt)
    else:
        k = tl.load(k_ptrs + pos64 * stride_kt, mask=dim_ok[None, :], other=0.0)
        v = tl.load(v_ptrs + pos64 * stride_vt, mask=dim_ok[None, :], other=0.0)
    return attend_tile(acc, m_i, l_i, q, k, v, None, sm_scale, 0.0, False, PRECISION, MASKED=False)


@triton.jit
def _query_tile(
    q_ptr, row0, head, n, stride_qt, stride_qh, head_dim, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):  # fmt: skip
    """Rows row0 .. row0 + ROWS and their queries ([ROWS, BLOCK_D], zero past n and head_dim)."""
    rows = row0 + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=(rows < n)[:, None] & (dims < head_dim)[None, :], other=0.0)
    return rows, dims, q


@triton.jit(do_not_specialize=LENGTH_ARGS)
def _walk_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, max_ptr, sum_ptr, k_desc, v_desc, run_first_ptr, run_last_ptr, run_cnt_ptr,
    sm_scale, n, num_qb, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_st, group, head_dim,
    kw_desc, vw_desc,
    BLOCK: tl.constexpr, QBLOCKS: tl.constexpr, KEY_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_D: tl.constexpr, DESC: tl.constexpr,
):  # fmt: skip
    """Pass 1: the selected block diagonals past the diagonal block, for QBLOCKS query blocks q0 ..
    q1 = q0 + QBLOCKS - 1 at once.

    A run of offsets a..b (a >= 1) reaches the key blocks max(q - b, 0) .. q - a from query block q,
    all before it. The blocks every row here reaches, max(q1 - b, 0) .. q0 - a, are walked without a
    mask, the address advancing one block a step, which Triton pipelines (reading an offset per block
    kept it from that); with QBLOCKS > 1 the few blocks only some rows reach (at most QBLOCKS - 1 at
    each end) are masked by row. Alone in its kernel, the walk keeps the registers and shared memory
    of a plain flash loop. The mask-free blocks go KEY_BLOCKS at a time (kw_desc / vw_desc load
    that many), an odd one last. Stores each row's normalised partial output and its running max and
    sum (sum 0: no key yet) for pass 2 to continue from.
    """
    q0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * QBLOCKS  # late query blocks first: a lighter tail
    q1 = q0 + QBLOCKS - 1
    head = tl.program_id(1)
    kv_head = head // group
    rows, dims, q = _query_tile(q_ptr, q0 * BLOCK, head, n, stride_qt, stride_qh, head_dim, QBLOCKS * BLOCK,
                                BLOCK_D)  # fmt: skip
    dim_ok = dims < head_dim
    k_ptrs = k_ptr + kv_head * stride_kh + dims[None, :]  # key row 0 of this KV head
    v_ptrs = v_ptr + kv_head * stride_vh + dims[None, :]
    acc = tl.zeros([QBLOCKS * BLOCK, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([QBLOCKS * BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QBLOCKS * BLOCK], dtype=tl.float32)
    runs = head * num_qb
    row_block = rows // BLOCK
    for r in range(0, tl.load(run_cnt_ptr + runs + tl.minimum(q1, num_qb - 1))):
        a = tl.load(run_first_ptr + runs + r)
        b = tl.load(run_last_ptr + runs + r)
        shared_lo = tl.maximum(q1 - b, 0)
        if QBLOCKS > 1:  # the blocks that only the rows of the first query blocks reach
            for j in range(tl.maximum(q0 - b, 0), shared_lo):
                reach = (j >= row_block - b) & (j <= row_block - a)
                acc, m_i, l_i = _key_block(acc, m_i, l_i, q, tl.where(reach, rows, -1), j, k_ptrs, v_ptrs,
                                           stride_kt, stride_vt, dim_ok, n, sm_scale, BLOCK, PRECISION)  # fmt: skip
        wide_end = shared_lo + (q0 - a + 1 - shared_lo) // KEY_BLOCKS * KEY_BLOCKS
        for start in range(shared_lo * BLOCK, wide_end * BLOCK, KEY_BLOCKS * BLOCK):
            acc, m_i, l_i = _inner_block(acc, m_i, l_i, q, start, k_ptrs, v_ptrs, stride_kt, stride_vt, dim_ok,
                                         sm_scale, kw_desc, vw_desc, kv_head * BLOCK_D, KEY_BLOCKS * BLOCK, EVEN_D,
                                         PRECISION, DESC)  # fmt: skip
        for start in range(wide_end * BLOCK, (q0 - a + 1) * BLOCK, BLOCK):  # what KEY_BLOCKS left over
            acc, m_i, l_i = _inner_block(acc, m_i, l_i, q, start, k_ptrs, v_ptrs, stride_kt, stride_vt, dim_ok,
                                         sm_scale, k_desc, v_desc, kv_head * BLOCK_D, BLOCK, EVEN_D, PRECISION,
                                         DESC)  # fmt: skip
        if QBLOCKS > 1:  # the blocks that only the rows of the last query blocks reach
            for j in range(tl.maximum(q0 - a + 1, shared_lo), q1 - a + 1):
                reach = (j >= row_block - b) & (j <= row_block - a)
                acc, m_i, l_i = _key_block(acc, m_i, l_i, q, tl.where(reach, rows, -1), j, k_ptrs, v_ptrs,
                                           stride_kt, stride_vt, dim_ok, n, sm_scale, BLOCK, PRECISION)  # fmt: skip
    row_ok = rows < n
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(max_ptr + head * stride_st + rows, m_i, mask=row_ok)
    tl.store(sum_ptr + head * stride_st + rows, l_i, mask=row_ok)


@triton.jit(do_not_specialize=(*LENGTH_ARGS, "max_b", "max_c"))
def _scattered_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, max_ptr, sum_ptr, kc_ptr, vc_ptr, kc_desc, vc_desc, k_desc, v_desc,
    cover_ptr, cover_cum_ptr, blocks_ptr, block_cnt_ptr, cols_ptr, col_cnt_ptr, tail_logit_ptr, tail_value_ptr,
    sm_scale, n, num_qb, max_b, max_c,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_st, stride_ch,
    group, head_dim,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr, DESC: tl.constexpr, COLS: tl.constexpr, CHUNKS: tl.constexpr,
    BITS: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """Pass 2: continues from pass 1's partial with the diagonal block (causally masked), the listed
    key blocks, the gathered columns (COLS a step) and, with TAIL, the query block's virtual key
    for the blocks the pattern skips (`tail.py`), and stores the final output."""
    qb = num_qb - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    hq = head * num_qb + qb
    rows, dims, q = _query_tile(q_ptr, qb * BLOCK, head, n, stride_qt, stride_qh, head_dim, BLOCK, BLOCK_D)
    row_ok = rows < n
    dim_ok = dims < head_dim
    k_ptrs = k_ptr + kv_head * stride_kh + dims[None, :]
    v_ptrs = v_ptr + kv_head * stride_vh + dims[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    # Pass 1's state: acc is its normalised output times its sum, relative to its max.
    m_i = tl.load(max_ptr + head * stride_st + rows, mask=row_ok, other=float("-inf"))
    l_i = tl.load(sum_ptr + head * stride_st + rows, mask=row_ok, other=0.0)
    acc = tl.load(out_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * l_i[:, None]

    # 1. Offset 0, the diagonal block.
    if tl.load(cover_ptr + head * num_qb) != 0:
        acc, m_i, l_i = _key_block(acc, m_i, l_i, q, rows, qb, k_ptrs, v_ptrs, stride_kt, stride_vt,
                                   dim_ok, n, sm_scale, BLOCK, PRECISION)  # fmt: skip

    # 2. Listed key blocks of this query block (already disjoint from the diagonals), ascending:
    # all before the query block, mask-free, except perhaps the last, the query block itself.
    n_listed = tl.load(block_cnt_ptr + hq)
    last = tl.load(blocks_ptr + hq * max_b + tl.maximum(n_listed - 1, 0))
    n_before = n_listed - ((n_listed > 0) & (last == qb)).to(tl.int32)
    slots = tl.arange(0, BLOCK_B)
    listed = tl.load(blocks_ptr + hq * max_b + slots, mask=slots < n_listed, other=-1)
    # The ids come from registers (no load before each step's K/V address), three steps in flight.
    for t in tl.range(0, n_before, num_stages=3):
        j = tl.sum(tl.where(slots == t, listed, 0), 0)
        acc, m_i, l_i = _inner_block(acc, m_i, l_i, q, j * BLOCK, k_ptrs, v_ptrs, stride_kt, stride_vt, dim_ok,
                                     sm_scale, k_desc, v_desc, kv_head * BLOCK_D, BLOCK, EVEN_D, PRECISION,
                                     DESC)  # fmt: skip
    if n_before < n_listed:
        acc, m_i, l_i = _key_block(acc, m_i, l_i, q, rows, qb, k_ptrs, v_ptrs, stride_kt, stride_vt,
                                   dim_ok, n, sm_scale, BLOCK, PRECISION)  # fmt: skip

    # 3. Key columns, COLS at a time, minus those inside a block walked above. Their keys and
    # values were gathered per head beforehand (`_gather_columns`), so each chunk is one contiguous
    # load; only the masks read the column positions. Triton 3.6 does not software-pipeline this
    # plain range for sm_90, and it stays plain: every pipelined form tried (tl.range at two or three
    # stages, descriptors or pointers) gave wrong outputs or illegal accesses on an H200
    # (docs/benchmarks/2026-12-01-pass2-pipelining-and-decode-warps-h200.md).
    n_cols = tl.load(col_cnt_ptr + hq)
    kc_ptrs = kc_ptr + head * stride_ch + dims[None, :]
    vc_ptrs = vc_ptr + head * stride_ch + dims[None, :]
    first_slot = head * (stride_ch // BLOCK_D)  # this head's first row in the gathered [H x C, D] view
    head_cols = cols_ptr + head * max_c
    if BITS:  # every chunk's mask-free test up front: the branch below waits on no load
        clean_bits = _clean_chunk_bits(head_cols, n_cols, cover_cum_ptr + head * num_qb, qb, listed, BLOCK, COLS,
                                       CHUNKS)  # fmt: skip
    for c0 in range(0, n_cols, COLS):
        # The gathered buffer is padded to whole chunks and BLOCK_D: no load mask at any head dim.
        if DESC:
            k = kc_desc.load([first_slot + c0, 0])
            v = vc_desc.load([first_slot + c0, 0])
        else:
            slot = (c0 + tl.arange(0, COLS)).to(tl.int64)[:, None] * BLOCK_D
            k = tl.load(kc_ptrs + slot)
            v = tl.load(vc_ptrs + slot)
        if BITS:
            clean = ((clean_bits >> (c0 // COLS)) & 1) != 0
        else:
            clean = _clean_chunk(
                head_cols, c0, n_cols, cover_cum_ptr + head * num_qb, qb, listed, BLOCK, COLS
            )
        if clean:
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, k, v, None, sm_scale, 0.0, False, PRECISION, MASKED=False
            )
        else:
            idx = c0 + tl.arange(0, COLS)
            ok = idx < n_cols
            col = tl.load(head_cols + idx, mask=ok, other=0)
            col_block = col // BLOCK
            on_diag = tl.load(cover_ptr + head * num_qb + qb - col_block, mask=ok, other=1)
            in_list = tl.sum((col_block[:, None] == listed[None, :]).to(tl.int32), 1)
            ok = ok & (on_diag == 0) & (in_list == 0)
            mask = ok[None, :] & (col[None, :] <= rows[:, None])
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, mask, sm_scale, 0.0, False, PRECISION)

    if TAIL:
        acc, l_i = _fold_tail(
            acc, m_i, l_i, tail_logit_ptr + hq, tail_value_ptr + hq * head_dim, dims, dim_ok
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _fold_tail(acc, m_i, l_i, logit_ptr, value_ptr, dims, dim_ok):
    """Fold one key shared by every row (logit: natural log, value [BLOCK_D]) into the running
    state, whose max is in base 2 (`attend_tile`); a logit of -inf adds nothing."""
    logit = tl.load(logit_ptr) * 1.4426950408889634
    value = tl.load(value_ptr + dims, mask=dim_ok, other=0.0)
    m_new = tl.maximum(m_i, logit)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the prompt: nothing seen
    alpha = tl.exp2(m_i - m_safe)
    weight = tl.exp2(logit - m_safe)
    return acc * alpha[:, None] + weight[:, None] * value[None, :], l_i * alpha + weight


@triton.jit
def _clean_chunk(head_cols, c0, n_cols, cover_cum, qb, listed, BLOCK: tl.constexpr, COLS: tl.constexpr):
    """Whether the COLS columns from c0 need no mask for query block qb: a whole chunk, every column
    before the block's first row, none inside a walked diagonal or a listed block. Columns ascend,
    so the first and last bound the chunk's key blocks lo..hi (diagonal offsets qb - hi .. qb - lo),
    and the cover's running count says whether any of those offsets was walked."""
    whole = c0 + COLS <= n_cols
    first = tl.load(head_cols + c0)
    last = tl.load(head_cols + tl.minimum(c0 + COLS, n_cols) - 1)
    lo, hi = first // BLOCK, last // BLOCK
    below_hi = qb - hi - 1
    walked = tl.load(cover_cum + qb - lo) - tl.load(
        cover_cum + tl.maximum(below_hi, 0), mask=below_hi >= 0, other=0
    )
    listed_in = tl.sum(((listed >= lo) & (listed <= hi)).to(tl.int32), 0)
    return whole & (last < qb * BLOCK) & (walked == 0) & (listed_in == 0)


@triton.jit
def _clean_chunk_bits(head_cols, n_cols, cover_cum, qb, listed, BLOCK: tl.constexpr, COLS: tl.constexpr,
                      CHUNKS: tl.constexpr):  # fmt: skip
    """`_clean_chunk` of the first CHUNKS chunks at once, as bits (chunk i: bit i), read as vectors
    before the loop rather than as dependent scalar loads inside it."""
    chunk = tl.arange(0, CHUNKS)
    c0 = chunk * COLS
    has = c0 < n_cols
    first = tl.load(head_cols + c0, mask=has, other=0)
    last = tl.load(head_cols + tl.minimum(c0 + COLS, n_cols) - 1, mask=has, other=0)
    lo, hi = first // BLOCK, last // BLOCK
    below_hi = qb - hi - 1
    walked = tl.load(cover_cum + qb - lo, mask=has, other=0) - tl.load(
        cover_cum + tl.maximum(below_hi, 0), mask=has & (below_hi >= 0), other=0
    )
    listed_in = tl.sum(((listed[None, :] >= lo[:, None]) & (listed[None, :] <= hi[:, None])).to(tl.int32), 1)
    clean = has & (c0 + COLS <= n_cols) & (last < qb * BLOCK) & (walked == 0) & (listed_in == 0)
    return tl.sum(tl.where(clean, 1 << chunk, 0), 0)


def _gather_columns(key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, num_heads: int, chunk: int):  # fmt: skip
    """Each query head's column keys and values, contiguous: [H, C rounded up to chunk, pow2(D)].

    Padded rows (columns past the sequence, the rounding) repeat the last key and the kernel masks
    them; padded dims are zeros, which add nothing to a score and are never stored.
    """
    n, num_kv_heads, head_dim = key.shape
    width = -(-columns.shape[1] // chunk) * chunk
    positions = torch.nn.functional.pad(columns, (0, width - columns.shape[1]), value=n)
    positions = positions.clamp(max=n - 1).long()
    kv_heads = (torch.arange(num_heads, device=key.device) // (num_heads // num_kv_heads))[:, None]
    pad_d = triton.next_power_of_2(head_dim) - head_dim
    gathered = [t[positions, kv_heads] for t in (key, value)]  # fresh [H, width, D] tensors
    if pad_d:
        gathered = [torch.nn.functional.pad(t, (0, pad_d)) for t in gathered]
    return gathered[0], gathered[1]


def _descriptors_apply(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernels load keys and values through tensor descriptors (TMA on Hopper and
    later) rather than pointers: a power-of-two head dim, heads adjacent in memory, 16-byte alignment."""
    if not USE_DESCRIPTORS:
        return False
    head_dim = key.shape[2]
    if not interpreting() and torch.cuda.get_device_capability(key.device)[0] < 9:
        return False
    return all(t.stride(1) == head_dim and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in (key, value)) and head_dim == triton.next_power_of_2(head_dim)  # fmt: skip


def _column_rows(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor of gathered columns [H, C, D] viewed as [H x C, D], `rows` columns at a time."""
    return TensorDescriptor(t, [t.shape[0] * t.shape[1], t.shape[2]], [t.shape[2], 1], [rows, t.shape[2]])


def _token_rows(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor of keys or values viewed as [n, KV heads x D] (one token's heads side by side),
    loading `rows` tokens of one head at a time."""
    n, heads, head_dim = t.shape
    return TensorDescriptor(t, [n, heads * head_dim], [t.stride(0), 1], [rows, head_dim])


def sparse_attention_kernel(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    key: torch.Tensor,  # [n, num_kv_heads, head_dim]
    value: torch.Tensor,
    index: SparseIndex,
    scale: float,
    out: torch.Tensor | None = None,
    tail: Tail | None = None,
) -> torch.Tensor:
    """Causal attention of one fresh prompt restricted to the index's blocks and columns, and with
    `tail` to one virtual key per query block for the blocks the index skips (`tail.py`).

    `out` must not overlap query, key or value: the first pass stores its partial output there.
    """
    n, num_heads, head_dim = query.shape
    group = num_heads // key.shape[1]
    out = torch.empty_like(query) if out is None else out
    assert query.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1 and out.stride(2) == 1
    num_qb = index.diag_cover.shape[1]
    block = index.block
    runs = diagonal_runs(index.diag_cover)
    # Padded to whole steps of any launch's columns (a few rows more than one launch needs).
    column_step = block * max(launch["column_blocks"] for launch in (LAUNCH, *FALLBACKS))
    key_cols, value_cols = _gather_columns(key, value, index.columns, num_heads, column_step)
    # Per head, how many diagonal offsets up to each one are walked: pass 2 tells from two reads
    # whether a chunk of columns meets any walked block.
    cover_cum = index.diag_cover.to(torch.int32).cumsum(1, dtype=torch.int32)
    # Pass 1's running max and sum per (head, row); its partial output goes to `out` itself.
    state = torch.empty(2, num_heads, num_qb * block, dtype=torch.float32, device=query.device)
    # Without a tail, pass 2 never reads these: any float32 tensor stands in.
    tail_logit, tail_value = (tail.logit, tail.value.contiguous()) if tail is not None else (state, state)
    use_desc = _descriptors_apply(key, value)
    k_desc, v_desc = (_token_rows(key, block), _token_rows(value, block)) if use_desc else (key, value)
    common = dict(BLOCK=block, BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=dot_precision(query.dtype),
                  EVEN_D=head_dim == triton.next_power_of_2(head_dim), DESC=use_desc)  # fmt: skip
    strides = (query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
               out.stride(0), out.stride(1), state.stride(1))  # fmt: skip

    def walk(launch: dict) -> None:
        launch = dict(launch)
        qblocks, key_blocks = launch.pop("qblocks"), launch.pop("key_blocks")
        wide = key_blocks * block  # the mask-free steps' keys
        kw_desc, vw_desc = (_token_rows(key, wide), _token_rows(value, wide)) if use_desc else (key, value)
        _walk_kernel[(triton.cdiv(num_qb, qblocks), num_heads)](
            query, key, value, out, state[0], state[1], k_desc, v_desc, runs.first, runs.last, runs.count,
            scale, n, num_qb, *strides, group, head_dim, kw_desc, vw_desc,
            QBLOCKS=qblocks, KEY_BLOCKS=key_blocks, **common, **launch,
        )  # fmt: skip

    def scattered(launch: dict) -> None:
        launch = dict(launch)
        cols = launch.pop("column_blocks") * block
        chunks = triton.cdiv(index.columns.shape[1], cols)
        kc_desc, vc_desc = (
            (_column_rows(key_cols, cols), _column_rows(value_cols, cols))
            if use_desc
            else (key_cols, value_cols)
        )
        _scattered_kernel[(num_qb, num_heads)](
            query, key, value, out, state[0], state[1], key_cols, value_cols, kc_desc, vc_desc, k_desc, v_desc,
            index.diag_cover, cover_cum, index.blocks, index.block_count, index.columns, index.column_count,
            tail_logit, tail_value, scale, n, num_qb, index.blocks.shape[2], index.columns.shape[1], *strides, key_cols.stride(0),
            group, head_dim, BLOCK_B=pow2(index.blocks.shape[2], 1), COLS=cols,
            CHUNKS=pow2(chunks, 1), BITS=chunks <= CLEAN_BITS_CHUNKS, TAIL=tail is not None, **common, **launch,
        )  # fmt: skip

    launch_fitting("sparse walk", query.device, (WALK_LAUNCH, *WALK_FALLBACKS), walk)
    launch_fitting("sparse pass 2", query.device, (LAUNCH, *FALLBACKS), scattered)
    return out
