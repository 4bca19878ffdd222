"""Triton vertical-slash estimation: the last queries' softmax attention over every key, reduced
to per-key (vertical) and per-block-diagonal (slash) mass, for every head in one launch.

Twin: `estimate.vertical_slash_scores` (last_q_stats + block_diagonal_scores). The torch twin holds
the [L, n] probabilities of each head (4 GiB for 32 heads at 512K, read and written several
times); here two passes over the keys recompute the scores tile by tile instead:

1. per (head, split of key tiles): running max and sum of exp of each last query's scores;
   torch folds the splits into each row's log-sum-exp.
2. per (head, split): probabilities; their column sums are the vertical scores (every key tile
   is owned by one program: plain stores), and their mass per block diagonal, with the same
   triangle weights as block_diagonal_scores (a token diagonal s lies (block - s % block) / block
   in block diagonal s // block and the rest in the next), lands in NBINS per-tile bins that
   torch shifts into place (deterministic: no atomics).

The heads sharing a KV head are adjacent in the grid, so each key tile is read from HBM once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.sparse.estimate import head_index, host_values
from tgserve.kernels.triton_common import LOG2E, dot_precision, pow2

TILES_PER_PROGRAM = 16
LAUNCH = {"num_warps": 4, "num_stages": 3}  # kernels/bench/profile_sparse.py sweeps


# Lengths and counts unspecialised, as kernel.LENGTH_ARGS: every prompt length shares one compile.
@triton.jit(do_not_specialize=["n", "num_tiles", "num_splits", "first_diag"])
def _last_q_kernel(
    q_ptr, k_ptr, head_ptr, m_ptr, l_ptr, lse_ptr, vert_ptr, bins_ptr,
    n, last, group, head_dim, stride_kt, stride_kh, num_tiles, num_splits, first_diag, qk_scale,
    STATS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    NBINS: tl.constexpr, PER_PROGRAM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    kv = tl.load(head_ptr + row) // group
    r = tl.arange(0, BLOCK_L)
    row_ok = r < last
    p = n - last + r  # query positions
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + (row * BLOCK_L + r)[:, None] * head_dim + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # fmt: skip
    k_ptrs = k_ptr + kv.to(tl.int64) * stride_kh + dims[None, :]
    lse = tl.load(lse_ptr + row * BLOCK_L + r)  # base 2; 0 on padded rows (pass 1 ignores it)
    m_i = tl.full([BLOCK_L], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_L], dtype=tl.float32)
    for t in range(split * PER_PROGRAM, tl.minimum(num_tiles, (split + 1) * PER_PROGRAM)):
        pos = t * BLOCK + tl.arange(0, BLOCK)
        k = tl.load(k_ptrs + pos.to(tl.int64)[:, None] * stride_kt, mask=(pos < n)[:, None] & dim_ok[None, :],
                    other=0.0)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(row_ok[:, None] & (pos[None, :] <= p[:, None]), s, float("-inf"))
        if STATS:
            prob = tl.exp2(s - lse[:, None])
            tl.store(vert_ptr + row.to(tl.int64) * n + pos, tl.sum(prob, 0), mask=pos < n)
            diag = tl.maximum(p[:, None] - pos[None, :], 0)
            d_lo = diag // BLOCK
            frac = (diag - d_lo * BLOCK).to(tl.float32) / BLOCK
            rel = d_lo - (first_diag - t - 1)  # bin 0 = the lowest block diagonal of this tile
            lo = prob * (1.0 - frac)
            hi = prob * frac
            out = bins_ptr + (row.to(tl.int64) * num_tiles + t) * NBINS
            for b in tl.static_range(NBINS):
                part = tl.where(rel == b, lo, 0.0) + tl.where(rel == b - 1, hi, 0.0)
                tl.store(out + b, tl.sum(tl.sum(part, 1), 0))
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
    if not STATS:
        o = (row * num_splits + split) * BLOCK_L + r
        tl.store(m_ptr + o, m_i)
        tl.store(l_ptr + o, l_i)


def last_q_scores_triton(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], scale: float, last_q: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and block-diagonal scores of the listed query heads: float32 [S, n] and [S, Q]."""
    n, num_heads, head_dim = query.shape
    group = num_heads // key.shape[1]
    rows, device = len(heads), query.device
    last = min(last_q, n)
    block_l = pow2(last)
    q_last = torch.zeros(rows, block_l, head_dim, dtype=query.dtype, device=device)
    q_last[:, :last] = query[n - last :, head_index(heads, device)].transpose(0, 1)
    tiles = triton.cdiv(n, block)
    splits = triton.cdiv(tiles, TILES_PER_PROGRAM)
    nbins = (last + block - 2) // block + 3
    first_diag = (n - last + 1) // block
    m = torch.empty(rows, splits, block_l, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    lse = torch.zeros(rows, block_l, dtype=torch.float32, device=device)
    vertical = torch.empty(rows, n, dtype=torch.float32, device=device)
    bins = torch.empty(rows, tiles, nbins, dtype=torch.float32, device=device)
    assert key.stride(2) == 1
    head_ids = host_values(heads, device)
    for stats in (False, True):
        _last_q_kernel[(rows, splits)](
            q_last, key, head_ids, m, l_sum, lse, vertical, bins,
            n, last, group, head_dim, key.stride(0), key.stride(1), tiles, splits, first_diag, scale * LOG2E,
            STATS=stats, BLOCK=block, BLOCK_L=block_l, BLOCK_D=triton.next_power_of_2(head_dim),
            NBINS=nbins, PER_PROGRAM=TILES_PER_PROGRAM, PRECISION=dot_precision(query.dtype), **LAUNCH,
        )  # fmt: skip
        if not stats:
            top = m.amax(1)
            top = torch.where(torch.isinf(top), 0.0, top)
            total = (l_sum * torch.exp2(m - top[:, None])).sum(1)
            lse = torch.where(total > 0, top + torch.log2(total), 0.0).contiguous()
    # Tile t's bin b is block diagonal first_diag - 1 - t + b: for each b, a reversed run of tiles.
    nq = tiles
    offset = tiles + nbins
    acc = torch.zeros(rows, offset + nq + tiles + 2 * nbins, dtype=torch.float32, device=device)
    for b in range(nbins):
        start = first_diag - tiles + b + offset
        acc[:, start : start + tiles] += bins[:, :, b].flip(1)
    return vertical, acc[:, offset : offset + nq]
