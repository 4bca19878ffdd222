"""The tail (kernels/sparse/tail.py): the key blocks a sparse pattern skips, folded back in as one
summarised key per query block, in the torch twin and in the Triton kernel's pass 2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tgserve.kernels import reference
from tgserve.kernels.sparse.attention import estimate_index, sparse_prefill
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.estimate import column_keys, held_blocks
from tgserve.kernels.sparse.index import index_to_mask
from tgserve.kernels.sparse.kernel import sparse_attention_kernel
from tgserve.kernels.sparse.tail import Tail, block_summaries, fold_tail, masked_lse, skipped_tail
from tgserve.kernels.sparse.tail_kernel import skipped_tail_triton

# The last-query slashes and top columns, few enough that most blocks are skipped.
SPARSE = HeadPattern("vertical_slash", vertical=24, slash=32, sink=16, local=16, rescue=1, tail=True)


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _block_uniform(n: int, heads: int, kv_heads: int, dim: int, block: int, seed: int):
    """Queries equal within each query block, keys and values equal within each key block: a
    block's mean key, value and query are then every row's, and the tail's estimate is exact."""
    gen = torch.Generator().manual_seed(seed)

    def blocks(h: int, spread: float) -> torch.Tensor:
        return (spread * torch.randn(n // block, h, dim, generator=gen)).repeat_interleave(block, 0)

    return blocks(heads, 1.0), blocks(kv_heads, 1.0), blocks(kv_heads, 1.0)


def test_tail_gives_dense_attention_where_blocks_are_uniform():
    """With block-uniform inputs, sparse + tail equals dense attention; without the tail it does not."""
    n, block, heads, kv_heads, scale = 512, 32, 4, 2, 0.3
    q, k, v = _block_uniform(n, heads, kv_heads, 16, block, seed=1)
    dense = reference.masked_attention(q, k, v, _causal(n), scale)
    with_tail = sparse_prefill(q, k, v, scale, [SPARSE] * heads, block, last_q=block)
    without = sparse_prefill(
        q, k, v, scale, [dataclasses.replace(SPARSE, tail=False)] * heads, block, last_q=block
    )
    index = estimate_index(q, k, scale, [SPARSE] * heads, block, last_q=block)
    assert index.density() < 0.6, "the pattern skips blocks"
    assert (without - dense).abs().max() > 1e-2, "skipping blocks changes the output"
    assert (with_tail - dense).abs().max() < 1e-4  # fp32 sums in another order on a GPU: 1.4e-5 seen


def test_columns_are_taken_out_of_the_tail():
    """A query block has a tail exactly when some key block before it is skipped (no selected
    diagonal, not listed) and holds a key that is not one of the head's columns; the sinks' first
    block, all columns, never counts."""
    n, block, heads = 256, 16, 2  # the 16 sinks are the first block
    q, k, v = (torch.randn(n, heads, 16, generator=torch.Generator().manual_seed(s)) for s in (2, 3, 4))
    index = estimate_index(q, k, 0.25, [SPARSE] * heads, block, last_q=block)
    tail = skipped_tail(q, k, v, index, 0.25)
    nq = n // block
    held = held_blocks(index.diag_cover.bool(), index.blocks)  # [H, Q, Q]
    columns = column_keys(index.columns, n).view(heads, nq, block)  # [H, key blocks, keys]
    assert columns[:, 0].all(), "the sinks fill the first block"
    other_keys = (~columns).any(-1)  # [H, key blocks]
    before = torch.ones(nq, nq, dtype=torch.bool).tril(-1)
    expected = (~held & before & other_keys[:, None, :]).any(-1)  # [H, Q]
    assert expected.any() and not expected.all()
    assert torch.equal(torch.isfinite(tail.logit), expected)


def test_block_summaries_are_each_blocks_keys_less_the_heads_columns():
    """Mean key and value, key count and spread of every key block, each query head's columns
    (sinks, verticals; -1 or past the prompt: none) left out, the last block partial."""
    n, block, heads, kv_heads, dim = 100, 16, 4, 2, 8
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    columns = torch.stack([torch.randperm(n, generator=gen)[:12] for _ in range(heads)])
    columns[:, -2:] = torch.tensor([-1, n + 5])
    columns[0, :3] = torch.tensor([96, 97, 98])  # most of the partial last block
    got = block_summaries(k, v, columns, block, spread=True)
    for h in range(heads):
        for j in range(-(-n // block)):
            keys = [t for t in range(j * block, min(n, (j + 1) * block)) if t not in columns[h].tolist()]
            kv_rows = k[keys, h // 2], v[keys, h // 2]
            assert got.log_count[h, j] == torch.log(torch.tensor(float(len(keys))))
            torch.testing.assert_close(got.key[h, j], kv_rows[0].mean(0))
            torch.testing.assert_close(got.value[h, j], kv_rows[1].mean(0))
            torch.testing.assert_close(
                got.spread[h, j], kv_rows[0].var(0, correction=0).mean(), atol=1e-5, rtol=1e-4
            )


def test_fold_tail_is_one_more_key():
    """Folding the tail equals attention over the kept keys plus one key of that logit and value."""
    n, heads, dim, block = 64, 2, 8, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, heads, dim, generator=gen) for _ in range(3))
    mask = _causal(n).expand(heads, n, n)
    out = reference.masked_attention(q, k, v, mask, 0.5)
    lse = masked_lse(q, k, mask, 0.5)
    tail_logit = torch.randn(heads, n // block, generator=gen)
    tail_value = torch.randn(heads, n // block, dim, generator=gen)
    folded = fold_tail(out, lse, Tail(tail_logit, tail_value), block)
    row = 40  # block 2
    scores = torch.einsum("hd,khd->hk", q[row], k[: row + 1]) * 0.5  # [H, row + 1]
    scores = torch.cat([scores, tail_logit[:, 2:3]], dim=1)
    values = torch.cat([v[: row + 1].transpose(0, 1), tail_value[:, 2:3]], dim=1)  # [H, row + 2, d]
    want = (torch.softmax(scores, -1)[:, None, :] @ values)[:, 0]
    assert torch.allclose(folded[row], want, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_folds_the_tail_as_the_twin_does(device, dtype):
    """Pass 2's last step against fold_tail over the masked reference (n = 150: a ragged last block)."""
    n, block, heads, kv_heads, scale = 150, 16, 4, 2, 0.2
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, h, 32, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    patterns = [SPARSE, dataclasses.replace(SPARSE, tail=False)] * (heads // 2)
    index = estimate_index(q, k, scale, patterns, block, last_q=16)
    tail = skipped_tail(q, k, v, index, scale, [p.tail for p in patterns])
    mask = index_to_mask(index)
    want = fold_tail(
        reference.masked_attention(q, k, v, mask, scale), masked_lse(q, k, mask, scale), tail, block
    )
    moved = estimate_index(q.to(device), k.to(device), scale, patterns, block, last_q=16)
    moved_tail = skipped_tail_triton(
        q.to(device), k.to(device), v.to(device), moved, scale, [p.tail for p in patterns]
    )
    out = sparse_attention_kernel(q.to(device), k.to(device), v.to(device), moved, scale, tail=moved_tail)
    assert torch.isfinite(out).all()
    tolerance = 2e-5 if dtype == torch.float32 and device == "cpu" else 2e-3  # TF32 tail on a GPU
    assert (out.cpu().float() - want.float()).abs().max() <= tolerance
    plain = sparse_attention_kernel(q.to(device), k.to(device), v.to(device), moved, scale)
    assert (plain.cpu().float() - want.float())[:, 1::2].abs().max() <= (
        2e-5 if dtype == torch.float32 else 2e-3
    )


@pytest.mark.parametrize("spread", [False, True])
def test_streamed_tail_equals_the_twin(device, spread):
    """The Triton tail against the torch twin: a ragged last block, heads without a tail, listed
    blocks from rescue picks and from a block-sparse head (several a row), with and without the
    log-normal term."""
    n, block, heads, kv_heads, scale = 300, 16, 4, 2, 0.2
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for h in (heads, kv_heads, kv_heads))
    patterns = [SPARSE, dataclasses.replace(SPARSE, tail=False),
                HeadPattern("block_sparse", blocks=4, rescue=1, tail=True), SPARSE]  # fmt: skip
    enabled = [p.tail for p in patterns]
    index = estimate_index(q, k, scale, patterns, block, last_q=16)
    assert (index.block_count[2] >= 3).any(), "the block-sparse head lists several blocks a row"
    want = skipped_tail(q, k, v, index, scale, enabled, spread)
    moved = estimate_index(q.to(device), k.to(device), scale, patterns, block, last_q=16)
    assert torch.equal(moved.blocks.cpu(), index.blocks) and torch.equal(
        moved.diag_cover.cpu(), index.diag_cover
    )
    got = skipped_tail_triton(q.to(device), k.to(device), v.to(device), moved, scale, enabled, spread)
    on = torch.tensor(enabled)[:, None] & torch.isfinite(want.logit)
    assert on.float().mean() > 0.3, "most query blocks of the tail heads skip something"
    assert torch.equal(torch.isfinite(got.logit.cpu()), on)
    tolerance = 1e-5 if device == "cpu" else 2e-3  # TF32 products on a GPU
    assert (got.logit.cpu()[on] - want.logit[on]).abs().max() <= tolerance
    assert (got.value.cpu()[on] - want.value[on]).abs().max() <= tolerance
