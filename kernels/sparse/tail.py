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

Cost: a [Q, Q] product per head of block means (1/4096 of dense attention's scores at block 64),
done here in torch ops; the kernel folds one key per row at the end of pass 2. Memory: a KV
group's [G, Q, Q] float32 scores and weights at a time (1 GiB each at 512K with G = 4, 4 GiB at
1M), which the whole-prompt memory profile does not count yet: a Triton version would stream them
as flash attention does its scores.
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


def _skippable_sums(
    key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head of one KV group: each block's sums of [key, |key|^2, value] over its keys
    that are not the head's columns (which pass 2 attends exactly), float32 [G, Q, 2d + 1], and
    how many keys those are, [G, Q]. key, value [n, d]; columns [G, C] (< 0 or >= n: none)."""
    n = key.shape[0]
    rows = torch.cat([key.float(), key.float().pow(2).sum(-1, keepdim=True), value.float()], dim=-1)
    sums = torch.nn.functional.pad(rows, (0, 0, 0, -n % block)).view(-1, block, rows.shape[-1]).sum(1)
    nq = sums.shape[0]
    valid = (columns >= 0) & (columns < n)
    at = torch.where(valid, columns.long() // block, nq)  # [G, C]; nq: a dropped slot
    picked = rows[columns.long().clamp(0, n - 1)] * valid[..., None]  # [G, C, 2d + 1]
    removed = torch.zeros(len(columns), nq + 1, rows.shape[-1], device=key.device)
    removed.scatter_add_(1, at[..., None].expand_as(picked), picked)
    taken = torch.zeros(len(columns), nq + 1, device=key.device).scatter_add_(1, at, valid.float())
    sizes = (n - torch.arange(nq, device=key.device) * block).clamp(max=block).float()
    return sums[None] - removed[:, :nq], sizes[None] - taken[:, :nq]


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

    KV group by group, so that at most one group's [G, Q, Q] scores are held (1 GiB at 512K, G 4).
    """
    heads, dim = query.shape[1], key.shape[-1]
    block = index.block
    nq = index.diag_cover.shape[1]
    group = heads // key.shape[1]
    q_mean = block_means(query, block)  # [Q, H, d]
    if spread:
        q_norm = block_means(query.float().pow(2).sum(-1, keepdim=True), block)[..., 0]  # [Q, H]
    i = torch.arange(nq, device=query.device)
    before = i[None, :] < i[:, None]  # key block j strictly before query block b
    logit = torch.full((heads, nq), -math.inf, device=query.device)
    out = torch.zeros(heads, nq, value.shape[-1], device=query.device)
    for kv in range(key.shape[1]):
        rows = slice(kv * group, (kv + 1) * group)
        sums, count = _skippable_sums(key[:, kv], value[:, kv], index.columns[rows], block)
        means = sums / count.clamp(min=1)[..., None]
        k_mean, v_mean = means[..., :dim], means[..., dim + 1 :]  # [G, Q, d]
        scores = (q_mean[:, rows].transpose(0, 1) @ k_mean.transpose(1, 2)) * scale  # [G, Q, Q]
        if spread:
            key_spread = (means[..., dim] - k_mean.pow(2).sum(-1)).clamp(min=0) / dim  # [G, Q]
            scores += 0.5 * scale**2 * q_norm[:, rows].t()[:, :, None] * key_spread[:, None, :]
        scores += torch.log(count)[:, None, :]  # -inf where the columns are the whole block
        held = held_blocks(index.diag_cover[rows].bool(), index.blocks[rows])
        scores.masked_fill_(held | ~before, -math.inf)
        top = scores.amax(-1, keepdim=True)
        weight = torch.exp(scores - top.clamp(min=-1e30))  # rows with nothing skipped: all zero
        total = weight.sum(-1)
        out[rows] = (weight @ v_mean) / total.clamp(min=1e-30)[..., None]
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
