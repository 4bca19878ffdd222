"""The k largest of each row, by radix select in one program a row: selective decode's top-k.

Selective decode ranks every block of a long context per KV head, then keeps the best `candidates`
(4 x 255 at a 4,096-token budget) for exact rescoring. torch.topk over those rows (8 of 32K-65K
bounds a layer at batch 1) took 46-51 us a layer on an H200, the largest part of the selection
(docs/benchmarks/2026-12-03-selective-decode-h200.md): ~1.5 ms a token at 1M over 32 layers.

Here one program takes one row: four passes of a 256-bin histogram of the scores' order-preserving
32-bit keys, each over the keys that share the digits found so far, find the exact key of the k-th
largest and how many of its ties to take; a last pass writes the indices of the keys above it and of
the first ties, in index order (deterministic, where torch's order is not). Five reads of a row of
128-256 KiB from L2. Twin: `torch.topk(..., sorted=False)` (the same set but for which ties).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import interpreting


@triton.jit
def _keys(row_ptr, offs, n):
    """Order-preserving unsigned keys (in int64) of float32 scores; 0 past the row's end."""
    valid = offs < n
    bits = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    return tl.where(valid, key, 0), valid


@triton.jit
def _top_k_kernel(scores_ptr, out_ptr, n, k, stride_row, stride_out, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_row
    bins = tl.arange(0, 512)
    prefix = tl.full([], 0, tl.int64)
    need = tl.full([], 0, tl.int64) + k  # of the keys matching the prefix, how many to take
    for round in tl.static_range(4):
        shift: tl.constexpr = 24 - 8 * round
        counts = tl.zeros([512], tl.int32)
        for start in range(0, n, CHUNK):
            key, valid = _keys(row_ptr, start + tl.arange(0, CHUNK), n)
            match = valid & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            counts += tl.histogram(tl.where(match, (key >> shift) & 255, 256).to(tl.int32), 512)
        counts = tl.where(bins < 256, counts, 0).to(tl.int64)
        at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # keys with digit >= bin
        digit = tl.max(tl.where((at_or_above >= need) & (bins < 256), bins, -1)).to(tl.int64)
        above = tl.sum(tl.where(bins > digit, counts, 0))
        need -= above
        prefix = prefix | (digit << shift)
    taken = tl.full([], 0, tl.int64)
    ties = tl.full([], 0, tl.int64)
    out_row = out_ptr + row.to(tl.int64) * stride_out
    for start in range(0, n, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        key, valid = _keys(row_ptr, offs, n)
        equal = valid & (key == prefix)
        tie_rank = ties + tl.cumsum(equal.to(tl.int64), 0) - 1
        take = (valid & (key > prefix)) | (equal & (tie_rank < need))
        at = taken + tl.cumsum(take.to(tl.int64), 0) - 1
        tl.store(out_row + at, offs.to(tl.int64), mask=take)
        taken += tl.sum(take.to(tl.int64))
        ties += tl.sum(equal.to(tl.int64))


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [..., k]: indices of each row's k largest of scores [..., n] (float32, k <= n), in
    index order; among equal scores the first ones."""
    *lead, n = scores.shape
    assert 0 < k <= n and scores.dtype == torch.float32
    rows = scores.reshape(-1, n)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=scores.device)
    chunk = 64 if interpreting() else 1024
    _top_k_kernel[(rows.shape[0],)](rows, out, n, k, rows.stride(0), out.stride(0), CHUNK=chunk, num_warps=8)
    return out.view(*lead, k)
