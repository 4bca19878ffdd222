"""Triton tail: the key blocks a sparse index skips, summarised per query block without [Q, Q].

Twin: `tail.skipped_tail`. One program per (tile of BLOCK_R query blocks, query head) streams the
key blocks before the tile as flash attention streams keys: block-mean query against each key
block's mean key (less the head's columns) plus log of its key count, blocks the index walks
(selected diagonals, listed blocks) masked out, an online softmax over the rest accumulating their
mean values. Nothing quadratic is written: the torch twin's [G, Q, Q] float32 scores and weights
would be 4 GiB a KV group at 1M tokens. Cost: Q^2 / 2 block pairs a head (1/4096 of dense causal
attention at block 64), in TF32 products on the GPU; the estimate, not the products, bounds its
accuracy. Programs are issued longest first, as the rescue estimate's are.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tgserve.kernels.sparse.estimate import block_means, host_values
from tgserve.kernels.sparse.index import SparseIndex
from tgserve.kernels.sparse.tail import Tail, block_summaries, squared_norms
from tgserve.kernels.triton_common import interpreting, launch_fitting, pow2

# Query blocks a program, key blocks a step, warps, stages; the second fits GPUs with less shared
# memory a block than an H200 (float32 tiles of 128-wide heads).
LAUNCHES = (
    {"block_r": 64, "block_j": 64, "num_warps": 4, "num_stages": 2},
    {"block_r": 32, "block_j": 32, "num_warps": 4, "num_stages": 1},
)


@triton.jit(do_not_specialize=["num_qb", "num_tiles", "num_rows", "max_listed"])
def _tail_kernel(
    qm_ptr, km_ptr, vm_ptr, bias_ptr, qn_ptr, ks_ptr, head_ptr, cover_ptr, listed_ptr, logit_ptr, out_ptr,
    num_qb, num_tiles, num_rows, max_listed, head_dim, scale, spread_coef,
    BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, SPREAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tile = num_tiles - 1 - pid // num_rows  # longest tiles first
    head = tl.load(head_ptr + pid % num_rows)
    qb = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = qb < num_qb
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    base = head.to(tl.int64) * num_qb  # every [H, Q, ...] input is indexed by (head, block)
    qm = tl.load(qm_ptr + (base + qb)[:, None] * head_dim + dims[None, :],
                 mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # fmt: skip
    if SPREAD:
        qn = tl.load(qn_ptr + base + qb, mask=row_ok, other=0.0) * spread_coef
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    last = tl.minimum(num_qb, tile * BLOCK_R + BLOCK_R) - 1  # the tile's last query block
    for j0 in range(0, last, BLOCK_J):  # key blocks strictly before it
        js = j0 + tl.arange(0, BLOCK_J)
        j_ok = js < num_qb
        at = (base + js)[:, None] * head_dim + dims[None, :]
        km = tl.load(km_ptr + at, mask=j_ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(qm, tl.trans(km), input_precision=PRECISION) * scale
        s += tl.load(bias_ptr + base + js, mask=j_ok, other=float("-inf"))[None, :]
        if SPREAD:
            s += qn[:, None] * tl.load(ks_ptr + base + js, mask=j_ok, other=0.0)[None, :]
        offset = qb[:, None] - js[None, :]
        before = (offset > 0) & row_ok[:, None]
        walked = tl.load(cover_ptr + base + offset, mask=before, other=1)  # a selected diagonal
        skipped = before & (walked == 0)
        for b in range(max_listed):  # a few a row (rescue picks and their neighbours' picks)
            listed = tl.load(listed_ptr + (base + qb) * max_listed + b, mask=row_ok, other=-1)
            skipped = skipped & (listed[:, None] != js[None, :])
        s = tl.where(skipped, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing skipped so far
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        vm = tl.load(vm_ptr + at, mask=j_ok[:, None] & dim_ok[None, :], other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, vm, input_precision=PRECISION)
        m_i = m_new
    has = l_i > 0
    total = tl.where(has, l_i, 1.0)
    tl.store(logit_ptr + base + qb, tl.where(has, m_i + tl.log(total), float("-inf")), mask=row_ok)
    tl.store(out_ptr + (base + qb)[:, None] * head_dim + dims[None, :], acc / total[:, None],
             mask=row_ok[:, None] & dim_ok[None, :])  # fmt: skip


def stacked_summaries(
    key: torch.Tensor, value: torch.Tensor, index: SparseIndex, spread: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every query head's key-block summaries (`tail.block_summaries`) for the kernel: float32
    mean keys and values [H, Q, d], log counts [H, Q], and the keys' spread [H, Q] (the log
    counts again, unread, without `spread`)."""
    summary = block_summaries(key, value, index.columns, index.block, spread)
    return summary.key, summary.value, summary.log_count, summary.spread if spread else summary.log_count


def skipped_tail_triton(
    query: torch.Tensor,  # [n, H, d]
    key: torch.Tensor,  # [n, Hkv, d]
    value: torch.Tensor,  # [n, Hkv, d]
    index: SparseIndex,
    scale: float,
    enabled: list[bool] | None = None,
    spread: bool = False,
) -> Tail:
    """`tail.skipped_tail` streamed by a Triton kernel: the same Tail, in TF32 products on a GPU."""
    n, heads, dim = query.shape
    block, nq, device = index.block, index.diag_cover.shape[1], query.device
    logit = torch.full((heads, nq), -math.inf, dtype=torch.float32, device=device)
    out = torch.zeros(heads, nq, dim, dtype=torch.float32, device=device)
    rows = [h for h in range(heads) if enabled is None or enabled[h]]
    if not rows:
        return Tail(logit=logit, value=out)
    k_mean, v_mean, log_count, key_spread = stacked_summaries(key, value, index, spread)
    q_mean = block_means(query, block).transpose(0, 1).contiguous()  # [H, Q, d]
    q_norm = log_count  # unread without spread
    if spread:
        q_norm = block_means(squared_norms(query), block)[..., 0].t().contiguous()
    head_rows = host_values(rows, device)
    listed = index.blocks.contiguous()

    def run(launch: dict) -> None:
        launch = dict(launch)
        block_r, block_j = launch.pop("block_r"), launch.pop("block_j")
        if interpreting():
            block_r = block_j = 16
        tiles = triton.cdiv(nq, block_r)
        _tail_kernel[(tiles * len(rows),)](
            q_mean, k_mean, v_mean, log_count, q_norm, key_spread, head_rows, index.diag_cover, listed,
            logit, out, nq, tiles, len(rows), listed.shape[-1], dim, scale, 0.5 * scale**2,
            BLOCK_R=block_r, BLOCK_J=block_j, BLOCK_D=pow2(dim), SPREAD=spread,
            PRECISION="ieee" if interpreting() else "tf32", **launch,
        )  # fmt: skip

    launch_fitting("sparse tail", device, LAUNCHES, run)
    return Tail(logit=logit, value=out)
