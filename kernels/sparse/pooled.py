"""Triton kernel: block-mean queries against every key, max-pooled per key block.

Twin: `estimate.pooled_max_scores`. It feeds the rescue blocks of estimated patterns: a key that
is salient only to queries in the middle of the prompt (invisible to the last-query estimate) still
wins its key block for the query blocks that want it. Fused so that the [Q, n] per-key scores are
never written to memory (at 512K tokens they would be ~17 GB per head); cost is ~1/block of the
dense QK^T. Grouped-query natively: rows are (query block, head of the group) pairs against the
group's one KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.sparse.estimate import block_means
from tgserve.kernels.triton_common import dot_precision, interpreting


@triton.jit
def _pooled_max_kernel(
    qm_ptr, k_ptr, skip_ptr, out_ptr, sm_scale, n, num_qb, group, head_dim, stride_kt,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SKIP: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    qb = rows // group
    g = rows % group
    row_ok = qb < num_qb
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    src = (g * num_qb + qb).to(tl.int64)
    qm = tl.load(qm_ptr + src[:, None] * head_dim + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                 other=0.0)  # fmt: skip
    last = tl.minimum(num_qb - 1, ((tile + 1) * BLOCK_R - 1) // group)
    for j in range(0, last + 1):
        pos = j * BLOCK + tl.arange(0, BLOCK)
        in_seq = pos < n
        k = tl.load(k_ptr + pos.to(tl.int64)[:, None] * stride_kt + dims[None, :],
                    mask=in_seq[:, None] & dim_ok[None, :], other=0.0)  # fmt: skip
        s = tl.dot(qm, tl.trans(k), input_precision=PRECISION) * sm_scale
        allowed = in_seq[None, :]
        if HAS_SKIP:
            skip = tl.load(skip_ptr + g.to(tl.int64)[:, None] * n + pos[None, :],
                           mask=row_ok[:, None] & in_seq[None, :], other=1)  # fmt: skip
            allowed = allowed & (skip == 0)
        best = tl.max(tl.where(allowed, s, float("-inf")), 1)
        best = tl.where(j <= qb, best, float("-inf"))
        tl.store(out_ptr + src * num_qb + j, best, mask=row_ok)


def pooled_max_scores_triton(
    q: torch.Tensor, k: torch.Tensor, scale: float, block: int, skip_keys: torch.Tensor | None = None
) -> torch.Tensor:
    """[G, Q, Q] float32 for q [n, G, d] against one KV head's keys k [n, d] (causal, -inf above).

    skip_keys: optional bool [G, n], keys left out of the max (already held as columns).
    """
    n, group, head_dim = q.shape
    nq = -(-n // block)
    qm = block_means(q, block).transpose(0, 1).to(k.dtype).contiguous()  # [G, Q, d]
    out = torch.full((group, nq, nq), float("-inf"), dtype=torch.float32, device=q.device)
    assert k.stride(1) == 1
    block_r = 16 if interpreting() else 64
    skip = out if skip_keys is None else skip_keys.to(torch.int8).contiguous()
    _pooled_max_kernel[(triton.cdiv(nq * group, block_r),)](
        qm, k, skip, out, scale, n, nq, group, head_dim, k.stride(0),
        BLOCK=block, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_SKIP=skip_keys is not None, PRECISION=dot_precision(k.dtype),
    )  # fmt: skip
    return out
