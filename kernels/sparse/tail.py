"""What a sparse pattern leaves out, estimated and folded back in as one key per query block.

On long prompts part of every row's attention is spread thinly over the whole prompt (each key
adds a little, and there are many keys). No choice of blocks at a few percent of the tiles holds
it, and dropping it does not only lose those keys' values: it renormalises the rest, scaling the
output up by the share it dropped. The tail estimates it cheaply instead: for query block b and
each key block j before it that the index does not walk (no selected diagonal, not listed), the
block's keys are summarised by their mean key k_j and mean value v_j, and weighted by

    c_j * exp(scale * q_b . k_j)

with q_b the block's mean query and c_j the block's key count. By Jensen's inequality this
undercounts a block whose keys vary along the query (the mean of exp(x) is at least exp of the
mean): it never adds more than the blocks hold when the rows' queries agree. The log-normal
correction, scale^2 / 2 * |q|^2_b * s_j with s_j the keys' per-dimension variance (`spread=True`),
is closer where the keys vary like noise but overshoots where they rotate (a RoPE pair of large
amplitude: the mean of exp(A cos t) is I0(A), not exp(A^2 / 4)): on 64K structured prompts it
took rope-smooth from 0.027 to 0.006 (means only: 0.0085) but rope-10k from 0.084 to 0.142 (means
only: 0.077), so means alone are the default. All skipped blocks of query block b
become one virtual key, appended to every row of the block: logit = log of the summed weight,
value = the weighted mean of the v_j. A query head's columns (sinks, vertical lines), which
pass 2 attends exactly, are taken out of its blocks' sums first: c_j is the block's key count
without them, and a block of columns alone (the sinks' first block) adds nothing.

Cost: a [Q, Q] product per head of block means (1/4096 of dense attention's scores at block 64);
the sparse kernel folds one key per row at the end of pass 2. On the GPU `tail_kernel.py` streams
the block scores as flash attention does its scores (float32 [H, Q, d] block means and output,
1 GiB at 1M tokens of 32 heads); this module's torch version, the twin, holds a KV group's
[G, Q, Q] float32 scores and weights at a time (1 GiB each at 512K with G = 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tgserve.kernels.sparse.estimate import block_means, held_blocks
from tgserve.kernels.sparse.index import SparseIndex


@dataclass
class Tail:
    """One virtual key per (query head, query block): the skipped key blocks, summarised."""

    logit: torch.Tensor  # float32 [H, Q]: natural log of the summed weight; -inf where none is skipped
    value: torch.Tensor  # float32 [H, Q, D]: the weighted mean of the skipped blocks' mean values


@dataclass
class BlockSummaries:
    """Per query head, each key block's keys less the head's columns, summarised."""

    key: torch.Tensor  # float32 [H, Q, d]: their mean key
    value: torch.Tensor  # float32 [H, Q, d]: their mean value
    log_count: torch.Tensor  # float32 [H, Q]: log of how many they are; -inf where none
    spread: torch.Tensor | None  # float32 [H, Q]: their keys' per-dimension variance (with spread)


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1]: each row's squared norm over the last dim, reduced straight from x's
    dtype (no float32 copy of x: a whole prompt's queries at 512K tokens would be 8 GiB)."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).pow(2)


def block_summaries(
    key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, block: int, spread: bool = False
) -> BlockSummaries:
    """The summaries of every key block for each query head, less that head's columns (which pass
    2 attends exactly). key, value [n, Hkv, d]; columns [H, C] (< 0 or >= n: none), query head h
    reading KV head h // (H / Hkv): all heads at once, a handful of launches whatever the heads.

    Block sums come from `block_means` (float32 sums straight from the input dtype): no float32
    copy of the keys, which at 1M tokens would be 512 MiB a KV head.
    """
    n, kv_heads, dim = key.shape
    heads, device = columns.shape[0], key.device
    kv_of = torch.arange(heads, device=device) // (heads // kv_heads)  # [H]
    nq = -(-n // block)
    sizes = (n - torch.arange(nq, device=device) * block).clamp(max=block).float()
    valid = (columns >= 0) & (columns < n)
    at = torch.where(valid, columns.long() // block, 0)  # [H, C]; an invalid slot removes zero
    taken = columns.long().clamp(0, n - 1)
    gone = torch.zeros(heads, nq, device=device).scatter_add_(1, at, valid.float())
    count = sizes[None] - gone  # [H, Q]

    def means(x: torch.Tensor) -> torch.Tensor:  # [n, Hkv, e] -> float32 [H, Q, e]
        sums = block_means(x, block).transpose(0, 1).index_select(0, kv_of)  # one copy, [H, Q, e]
        sums.mul_(sizes[None, :, None])
        picked = x[taken, kv_of[:, None]].float() * valid[..., None]  # [H, C, e]
        sums.scatter_add_(1, at[..., None].expand_as(picked), -picked)
        return sums.div_(count.clamp(min=1)[..., None])

    k_mean = means(key)
    key_spread = None
    if spread:
        key_spread = (means(squared_norms(key))[..., 0] - k_mean.pow(2).sum(-1)).clamp(min=0) / dim
    return BlockSummaries(k_mean, means(value), torch.log(count), key_spread)


def skipped_tail(
    query: torch.Tensor,  # [n, H, d]
    key: torch.Tensor,  # [n, Hkv, d]
    value: torch.Tensor,  # [n, Hkv, d]
    index: SparseIndex,
    scale: float,
    enabled: list[bool] | None = None,
    spread: bool = False,
) -> Tail:
    """The virtual key of every query block: the key blocks before it that the index skips, less
    the head's columns, for the query heads `enabled` (all by default; the others get none:
    logit -inf); `spread` adds the log-normal correction (see the module's note).

    The torch twin of `tail_kernel.skipped_tail_triton`. KV group by group, so that at most one
    group's [G, Q, Q] scores are held (1 GiB at 512K, G 4).
    """
    heads = query.shape[1]
    block = index.block
    nq = index.diag_cover.shape[1]
    group = heads // key.shape[1]
    q_mean = block_means(query, block)  # [Q, H, d]
    if spread:
        q_norm = block_means(squared_norms(query), block)[..., 0]  # [Q, H]
    i = torch.arange(nq, device=query.device)
    before = i[None, :] < i[:, None]  # key block j strictly before query block b
    logit = torch.full((heads, nq), -math.inf, device=query.device)
    out = torch.zeros(heads, nq, value.shape[-1], device=query.device)
    for kv in range(key.shape[1]):
        rows = slice(kv * group, (kv + 1) * group)
        summary = block_summaries(
            key[:, kv : kv + 1], value[:, kv : kv + 1], index.columns[rows], block, spread
        )
        scores = (q_mean[:, rows].transpose(0, 1) @ summary.key.transpose(1, 2)) * scale  # [G, Q, Q]
        if spread:
            scores += 0.5 * scale**2 * q_norm[:, rows].t()[:, :, None] * summary.spread[:, None, :]
        scores += summary.log_count[:, None, :]  # -inf where the columns are the whole block
        held = held_blocks(index.diag_cover[rows].bool(), index.blocks[rows])
        scores.masked_fill_(held | ~before, -math.inf)
        top = scores.amax(-1, keepdim=True)
        weight = torch.exp(scores - top.clamp(min=-1e30))  # rows with nothing skipped: all zero
        total = weight.sum(-1)
        out[rows] = (weight @ summary.value) / total.clamp(min=1e-30)[..., None]
        logit[rows] = torch.where(total > 0, top[..., 0] + torch.log(total.clamp(min=1e-30)), -math.inf)
    if enabled is not None and not all(enabled):
        off = torch.tensor([not on for on in enabled], device=query.device)
        logit.masked_fill_(off[:, None], -math.inf)
    return Tail(logit=logit, value=out)


def fold_tail(out: torch.Tensor, lse: torch.Tensor, tail: Tail, block: int) -> torch.Tensor:
    """Fold each query block's virtual key into a sparse output [n, H, d] whose rows' natural
    log-sum-exp of kept scores is lse [n, H] (float32): the twin of pass 2's last step."""
    n = out.shape[0]
    blocks = torch.arange(n, device=out.device) // block
    tail_logit = tail.logit.t()[blocks]  # [n, H]
    top = torch.maximum(lse, tail_logit)
    kept, skipped = torch.exp(lse - top), torch.exp(tail_logit - top)
    value = tail.value.transpose(0, 1)[blocks]  # [n, H, d]
    mixed = (out.float() * kept[..., None] + value * skipped[..., None]) / (kept + skipped)[..., None]
    return mixed.to(out.dtype)


def masked_lse(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [n, H]: each row's natural log-sum-exp of its scores under mask [H, n, n] (the
    twin's counterpart of the kernel's running max and sum)."""
    group = query.shape[1] // key.shape[1]
    q = query.float().transpose(0, 1)  # [H, n, d]
    k = key.float().transpose(0, 1).repeat_interleave(group, 0)  # [H, n, d]
    scores = (q @ k.transpose(1, 2)) * scale
    return torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1).t().contiguous()
