"""Triton rescue estimation: block-mean queries against every key, max-pooled per key block, and
the top key blocks a pattern does not hold yet, fused for every head in one launch.

Twin: `estimate.rescue_blocks`. A key salient only to queries in the middle of the prompt (the
blind spot of last-query estimation) still wins its key block for the query blocks that want it.
Max- rather than mean-pooling the keys keeps a single salient key visible; keys the head already
holds as columns are left out of the max, and blocks it already holds (selected block diagonals,
listed blocks) out of the top-k, so a rescue block always adds something.

Nothing quadratic is written to memory: one program per (tile of BLOCK_R query blocks, head)
walks the causal key blocks and keeps a running top-R per query block in registers (the torch
twin's [Q, n] scores would be ~17 GB per head at 512K, its [Q, Q] matrix 256 MiB). Cost is the
QK^T of the block means, 1/(2 * block) of dense causal attention. Programs are issued longest first
(the last query blocks see the most keys) so that the causal imbalance packs into few waves.
Grouped-query natively: a head reads the keys of head // group in place.

With RANGE (a pattern's `rescue_range` blocks, a second launch after the mean's picks, which it
treats as held) the query side is the block's range: per coordinate the midpoint of its largest
and smallest value against the key, plus the half-width against the key's magnitude (the same as
largest x positive part + smallest x negative part). That bounds the largest logit any query of
the block gives the key, so a key that 16 of the 64 queries seek keeps its whole logit, where
their mean holds a quarter of it. The two products are added, so each row keeps its scale. In
bf16 products this pass cost 2.8x the mean's at 128K and 4.2x at 1M on an H200 (8.99 / 3.18 ms,
453 / 109 ms); in e4m3, as below, 2.0x at 128K and 2.2x at 512K on an H100 (6.11 / 3.07 ms,
60.1 / 27.6 ms; 2026-12-05-glue-and-moe-tiles-h100.md).

From 16-bit inputs the products are e4m3: each block-mean query scaled so its largest element is
448 (`fp8_format.quantize_rows`), and each KV head's keys by one scale (`tensor_scale`), so that
the scores need no per-key factor: a row's products are left unscaled, its query's scale and its
head's key scale being positive factors of the whole row, and the ranking is within a row. e4m3
is a float format, so one scale a head costs no relative precision above 2^-6 of the head's largest
element. The twin rounds the same rows to the same e4m3 values, so both rank the same scores;
fp32 inputs (exact tests) keep fp32 products.

The estimate grows with the square of the prompt. At 1M tokens of Llama-3-8B's shape on an H200
(one layer, random bf16): 166 ms in bf16 products, 142 in e4m3 with a scale a key (the products
are not most of the time); the per-key scale's multiply cost 16 ms and the per-key column mask
15 ms, which one scale a head and masking only the steps that need it remove: 142.7 -> 112.6 ms
(128K: 3.7 -> 3.5-3.8, within the run-to-run spread).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.fp8 import quantize_rows_fast
from tgserve.kernels.fp8_format import FP8, INV_FP8_MAX, TINY_SCALE
from tgserve.kernels.sparse.estimate import (
    block_means,
    column_keys,
    fp8_products,
    head_index,
    host_values,
    range_rows,
)
from tgserve.kernels.triton_common import dot_precision, interpreting

BITS = 16  # listed blocks travel as a bitmap of BITS-bit words per query block
# GPU: fastest of profile_sparse.py sweep (H200, 128K, ms a layer: this 3.47, one key block a step
# at 3 stages 3.71, two at 3 stages 3.81). key_blocks: key blocks a step (one product of
# key_blocks * block keys, max-pooled per block).
LAUNCH = {"block_r": 128, "num_warps": 4, "num_stages": 2, "key_blocks": 2, "split_dots": True}
# split_dots: a product per key block, each row's max taken over its own product, instead of one
# product over KEY_BLOCKS blocks reshaped to pool per block (the reshape may move the product's
# registers through shared memory). Same picks; on an H200 3.11 -> 2.95 ms at 128K, and a
# 1M-token prompt's first token 34.9-35.7 s -> 34.9-35.0 s (2026-12-05-sparse-costs-h200.md).


@triton.jit
def _magnitude(k):
    """|k|; of e4m3 values by clearing the sign bit (no float conversion)."""
    if k.dtype == tl.float8e4nv:
        return (k.to(tl.uint8, bitcast=True) & 0x7F).to(tl.float8e4nv, bitcast=True)
    return tl.abs(k)


@triton.jit
def _key_scores(qm, ql, qm_scale, ql_scale, k_ptrs, pos, n, stride_kt, dim_ok, skip_row_ptr, masked,
                HAS_SKIP: tl.constexpr, PRECISION: tl.constexpr, RANGE: tl.constexpr):  # fmt: skip
    """Block-mean queries x the keys at `pos` (RANGE: the range bound, qm the blocks' range
    midpoints against the keys plus ql their half-widths against the keys' magnitudes, each
    product times its rows' scales); with `masked`, keys past n and the head's columns
    (skip_row_ptr: this row's per-key flags) at -inf."""
    in_seq = pos < n
    k = tl.load(
        k_ptrs + pos.to(tl.int64)[:, None] * stride_kt, mask=in_seq[:, None] & dim_ok[None, :], other=0.0
    )
    if RANGE:
        s = tl.dot(qm, tl.trans(k), input_precision=PRECISION) * qm_scale[:, None]
        s += tl.dot(ql, tl.trans(_magnitude(k)), input_precision=PRECISION) * ql_scale[:, None]
    else:
        s = tl.dot(qm, tl.trans(k), input_precision=PRECISION)
    if masked:
        allowed = in_seq
        if HAS_SKIP:
            allowed = allowed & (tl.load(skip_row_ptr + pos, mask=in_seq, other=1) == 0)
        s = tl.where(allowed[None, :], s, float("-inf"))
    return s


@triton.jit
def program_tile(num_tiles, num_rows, num_qb, head_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A rescue program's share: (tile, head row, its query blocks, which are in range, the head
    dims, which are in range, the row's first query block in [rows, Q] tensors). Tiles are issued
    longest first (the last query blocks see the most keys), all heads of a tile together."""
    pid = tl.program_id(0)
    tile = num_tiles - 1 - pid // num_rows
    row = pid % num_rows
    qb = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    return tile, row, qb, qb < num_qb, dims, dims < head_dim, row.to(tl.int64) * num_qb


# Lengths and counts unspecialised, as kernel.LENGTH_ARGS: every prompt length shares one compile.
@triton.jit(do_not_specialize=["n", "num_qb", "num_tiles", "num_rows", "words"])
def _rescue_kernel(
    qm_ptr, ql_ptr, qs_ptr, ls_ptr, k_ptr, head_ptr, skip_ptr, skip_blocks_ptr, cover_ptr, bits_ptr, val_ptr, idx_ptr,
    n, num_qb, num_tiles, num_rows, group, head_dim, stride_kt, stride_kh, words,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr,
    HAS_SKIP: tl.constexpr, HAS_BITS: tl.constexpr, PRECISION: tl.constexpr, KEY_BLOCKS: tl.constexpr,
    SPLIT_DOTS: tl.constexpr = False, RANGE: tl.constexpr = False,
):  # fmt: skip
    tile, row, qb, row_ok, dims, dim_ok, base = program_tile(
        num_tiles, num_rows, num_qb, head_dim, BLOCK_R, BLOCK_D
    )
    kv = tl.load(head_ptr + row) // group
    q_at = (base + qb)[:, None] * head_dim + dims[None, :]
    qm = tl.load(qm_ptr + q_at, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    ql, qm_scale, ql_scale = qm, row_ok, row_ok  # unread without RANGE
    if RANGE:
        ql = tl.load(ql_ptr + q_at, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        qm_scale = tl.load(qs_ptr + base + qb, mask=row_ok, other=0.0)
        ql_scale = tl.load(ls_ptr + base + qb, mask=row_ok, other=0.0)
    k_ptrs = k_ptr + kv.to(tl.int64) * stride_kh + dims[None, :]
    slots = tl.arange(0, R)
    best_v = tl.full([BLOCK_R, R], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_R, R], -1, tl.int32)
    last = tl.minimum(num_qb - 1, tile * BLOCK_R + BLOCK_R - 1)
    sub = tl.arange(0, KEY_BLOCKS)
    skip_row = skip_ptr + row.to(tl.int64) * n
    for j0 in range(0, last + 1, KEY_BLOCKS):
        # KEY_BLOCKS key blocks a step, max-pooled per block (blocks past `last` are invisible to
        # every row of the tile). Keys past n (the last step) and the head's columns are masked; a
        # step whose blocks hold neither (nearly all: a head has ~1,000 columns in thousands of
        # blocks) skips the per-key load and select (13% of the kernel's time at 1M tokens).
        if SPLIT_DOTS:
            pooled = tl.full([BLOCK_R, KEY_BLOCKS], float("-inf"), tl.float32)
            for b in tl.static_range(KEY_BLOCKS):
                masked = (j0 + b + 1) * BLOCK > n
                if HAS_SKIP:
                    flag = tl.load(skip_blocks_ptr + base + j0 + b, mask=j0 + b < num_qb, other=0)
                    masked = masked | (flag > 0)
                pos = (j0 + b) * BLOCK + tl.arange(0, BLOCK)
                s = _key_scores(qm, ql, qm_scale, ql_scale, k_ptrs, pos, n, stride_kt, dim_ok, skip_row, masked,
                                HAS_SKIP, PRECISION, RANGE)  # fmt: skip
                pooled = tl.where(sub[None, :] == b, tl.max(s, 1)[:, None], pooled)
        else:  # one product over the step's blocks, pooled through a reshape
            masked = (j0 + KEY_BLOCKS) * BLOCK > n
            if HAS_SKIP:
                flags = tl.load(skip_blocks_ptr + base + j0 + sub, mask=j0 + sub < num_qb, other=0)
                masked = masked | (tl.max(flags, 0) > 0)
            pos = j0 * BLOCK + tl.arange(0, KEY_BLOCKS * BLOCK)
            s = _key_scores(qm, ql, qm_scale, ql_scale, k_ptrs, pos, n, stride_kt, dim_ok, skip_row, masked,
                            HAS_SKIP, PRECISION, RANGE)  # fmt: skip
            pooled = tl.max(tl.reshape(s, [BLOCK_R, KEY_BLOCKS, BLOCK]), 2)  # [BLOCK_R, KEY_BLOCKS]
        for b in tl.static_range(KEY_BLOCKS):
            j = j0 + b
            score = tl.max(tl.where(sub[None, :] == b, pooled, float("-inf")), 1)
            visible = row_ok & (qb >= j)
            held = tl.load(cover_ptr + base + qb - j, mask=visible, other=1)
            if HAS_BITS:
                word = tl.load(bits_ptr + (base + qb) * words + j // 16, mask=visible, other=0)
                held = held | ((word >> (j % 16)) & 1).to(tl.int8)
            score = tl.where(visible & (held == 0), score, float("-inf"))
            # Running top-R: the new block replaces the weakest kept one if it beats it.
            weakest = tl.argmin(best_v, 1)
            hit = (slots[None, :] == weakest[:, None]) & (score > tl.min(best_v, 1))[:, None]
            best_v = tl.where(hit, score[:, None], best_v)
            best_i = tl.where(hit, j, best_i)
    out = (base + qb)[:, None] * R + slots[None, :]
    tl.store(val_ptr + out, best_v, mask=row_ok[:, None])
    tl.store(idx_ptr + out, best_i, mask=row_ok[:, None])


def listed_bitmap(listed: torch.Tensor, nq: int) -> torch.Tensor:
    """int32 [S, Q, W]: bit (b % 16) of word b // 16 set where key block b is listed (-1 = none)."""
    words = -(-nq // BITS)
    ordered = listed.long().sort(-1).values
    repeated = torch.zeros_like(ordered, dtype=torch.bool)
    repeated[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    valid = (ordered >= 0) & ~repeated
    word = torch.where(valid, ordered // BITS, words)
    bit = torch.where(valid, 1 << (ordered.clamp(min=0) % BITS), 0).to(torch.int32)
    bits = torch.zeros(*listed.shape[:2], words + 1, dtype=torch.int32, device=listed.device)
    bits.scatter_add_(2, word, bit)  # distinct bits: the sum is the OR
    return bits[..., :words].contiguous()


def _e4m3_keys(key: torch.Tensor) -> torch.Tensor:
    """e4m3 [n, Hkv, d] of key [n, Hkv, d], one scale a KV head (`fp8_format.tensor_scale` of
    key[:, h], from two reductions over all heads at once), quantized in one launch."""
    n, num_kv, dim = key.shape
    amax = torch.maximum(key.amax(dim=(0, 2)), -key.amin(dim=(0, 2))).float().clamp(min=TINY_SCALE)
    scales = (amax * INV_FP8_MAX)[:, None]  # [Hkv, 1]: as tensor_scale gives each head's, bit for bit
    rows = key.reshape(n * num_kv, dim)
    return quantize_rows_fast(rows, scales.repeat(n, 1))[0].view(n, num_kv, dim)


def rescue_keys(key: torch.Tensor) -> torch.Tensor:
    """The keys a rescue launch reads: e4m3 ones from 16-bit keys (`_e4m3_keys`), else `key`. The
    launches by the mean and by the range share one quantization (an H100 at 32K: two reductions
    and a quantization, ~0.16 ms a layer)."""
    return _e4m3_keys(key) if fp8_products(key) else key


def _range_rows(
    query: torch.Tensor, key: torch.Tensor, heads: slice | torch.Tensor, block: int, e4m3: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The listed heads' range midpoints and half-widths (`estimate.range_rows`), [S * Q, d] each,
    with float32 row scales [S * Q]: e4m3 rows where the products are e4m3, the keys' dtype and
    scales of one otherwise."""
    mid, radius = (x[heads].reshape(-1, query.shape[-1]) for x in range_rows(query, block))
    if e4m3:
        (mid, mid_scale), (radius, radius_scale) = quantize_rows_fast(mid), quantize_rows_fast(radius)
        return mid, radius, mid_scale.reshape(-1).contiguous(), radius_scale.reshape(-1).contiguous()
    ones = torch.ones(mid.shape[0], dtype=torch.float32, device=mid.device)
    return mid.to(key.dtype).contiguous(), radius.to(key.dtype).contiguous(), ones, ones


def rescue_blocks_triton(
    query: torch.Tensor, key: torch.Tensor, heads: list[int], block: int, cover: torch.Tensor,
    listed: torch.Tensor | None, columns: torch.Tensor | None, budget: list[int], query_range: bool = False,
) -> torch.Tensor:  # fmt: skip
    """[S, Q, K] rescue key blocks of the listed query heads; see `estimate.rescue_blocks`.

    query [n, H, d], key [n, Hkv, d]; cover bool [S, Q] selected block diagonals; listed
    [S, Q, b] listed blocks and columns [S, C] key columns (-1 = none), K = min(Q, max(budget)).
    query_range: the query blocks' range bound instead of their mean (two products, e4m3 ones
    from 16-bit inputs with each row's scale applied). key may be `rescue_keys(key)` already.
    """
    n, num_heads, head_dim = query.shape
    group = num_heads // key.shape[1]
    nq, rows, device = cover.shape[-1], len(heads), query.device
    width = max(1, min(nq, max(budget)))
    top_r = max(2, triton.next_power_of_2(width))
    at = head_index(heads, device)
    key = rescue_keys(key)
    e4m3 = key.dtype == FP8
    if query_range:  # midpoints and half-widths of the blocks' ranges, each row with its scale
        qm, ql, qm_scale, ql_scale = _range_rows(query, key, at, block, e4m3)
    else:
        qm = block_means(query, block)[:, at].transpose(0, 1)  # [S, Q, d]
        qm = quantize_rows_fast(qm.reshape(-1, head_dim))[0] if e4m3 else qm.to(key.dtype).contiguous()
        unread = torch.empty(1, dtype=torch.float32, device=device)
        ql, qm_scale, ql_scale = qm, unread, unread  # the range's operands, unread here
    cover8 = cover.to(torch.int8).contiguous()
    skip = skip_blocks = bits = cover8  # placeholders when absent
    if columns is not None:
        skip, skip_blocks = column_flags(columns, n, block)
    if listed is not None:
        bits = listed_bitmap(listed, nq)
    values = torch.empty(rows, nq, top_r, dtype=torch.float32, device=device)
    index = torch.empty(rows, nq, top_r, dtype=torch.int32, device=device)
    block_r = 16 if interpreting() else LAUNCH["block_r"]
    tiles = triton.cdiv(nq, block_r)
    assert key.stride(2) == 1
    _rescue_kernel[(tiles * rows,)](
        qm, ql, qm_scale, ql_scale, key, host_values(heads, device), skip, skip_blocks, cover8, bits, values, index,
        n, nq, tiles, rows, group, head_dim, key.stride(0), key.stride(1), -(-nq // BITS),
        BLOCK=block, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(head_dim), R=top_r,
        HAS_SKIP=columns is not None, HAS_BITS=listed is not None, PRECISION=dot_precision(key.dtype),
        num_warps=4 if interpreting() else LAUNCH["num_warps"], num_stages=LAUNCH["num_stages"],
        KEY_BLOCKS=LAUNCH["key_blocks"], SPLIT_DOTS=LAUNCH.get("split_dots", False), RANGE=query_range,
    )  # fmt: skip
    return top_picks(values, index, width, budget)


def column_flags(columns: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ([S, n], [S, Q]) of columns [S, C] (-1 = none): 1 at each listed head's column keys,
    and at the key blocks holding one (the only blocks whose keys need the per-key mask)."""
    nq = -(-n // block)
    at = torch.where((columns >= 0) & (columns < n), columns.long() // block, nq)
    skip_blocks = torch.zeros(columns.shape[0], nq + 1, dtype=torch.int8, device=columns.device)
    skip_blocks.scatter_(1, at, 1)
    return column_keys(columns, n).to(torch.int8), skip_blocks[:, :nq].contiguous()


def top_picks(values: torch.Tensor, index: torch.Tensor, width: int, budget: list[int]) -> torch.Tensor:
    """[S, Q, width] of a kernel's running top-R per row (values float32 [S, Q, R], -inf = none;
    index int32 key blocks): best first, budget[s] of them, -1 padded."""
    top = torch.topk(values, width, dim=-1)
    limit = host_values(budget, values.device)[:, None, None]
    keep = (top.values > float("-inf")) & (torch.arange(width, device=values.device) < limit)
    return torch.where(keep, index.gather(-1, top.indices), -1)
