"""Sparse index estimation and pattern semantics, against brute force (torch only, fast)."""

from __future__ import annotations

import torch

from tgserve.kernels import reference
from tgserve.kernels.sparse import estimate
from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.index import index_to_mask


def test_last_q_stats_match_brute_force():
    gen = torch.Generator().manual_seed(0)
    n, last, scale = 40, 8, 0.3
    q, k = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 16, generator=gen)
    vertical, slash = estimate.last_q_stats(q, k, scale, last)
    want_v, want_s = torch.zeros(2, n), torch.zeros(2, n)
    for g in range(2):
        for p in range(n - last, n):
            probs = torch.softmax((k[: p + 1] @ q[p, g]) * scale, 0)
            want_v[g, : p + 1] += probs
            for t in range(p + 1):
                want_s[g, p - t] += probs[t]
    torch.testing.assert_close(vertical, want_v)
    torch.testing.assert_close(slash, want_s)


def test_block_diagonal_scores_weigh_each_diagonal_by_its_share():
    gen = torch.Generator().manual_seed(1)
    n, block = 50, 8
    slash = torch.rand(1, n, generator=gen)
    got = estimate.block_diagonal_scores(slash, block)
    nq = -(-n // block)
    want = torch.zeros(1, nq)
    for d in range(nq):
        for s in range(n):
            want[0, d] += slash[0, s] * max(0, block - abs(s - d * block)) / block
    torch.testing.assert_close(got, want)


def test_vertical_slash_always_keeps_sinks_and_nearest_diagonals():
    gen = torch.Generator().manual_seed(2)
    n, block = 256, 16
    q, k = torch.randn(n, 2, 32, generator=gen), torch.randn(n, 1, 32, generator=gen)
    pattern = HeadPattern("vertical_slash", vertical=8, slash=16, sink=8, local=20, rescue=0)
    mask = index_to_mask(estimate_index(q, k, 0.2, [pattern] * 2, block, last_q=32))
    must = reference.a_shape_mask(n, sink=8, local=20)
    assert (mask | ~must).all()
    assert mask.float().mean() < 0.5 * reference.causal_mask(n, n).float().mean()


def test_a_shape_is_the_element_pattern_rounded_out_to_blocks():
    n, block, sink, local = 200, 16, 5, 40
    q, k = torch.randn(n, 1, 16), torch.randn(n, 1, 16)
    mask = index_to_mask(estimate_index(q, k, 0.2, [HeadPattern("a_shape", sink=sink, local=local)], block))[
        0
    ]
    assert (mask | ~reference.a_shape_mask(n, sink, local)).all()  # superset of the pattern
    assert not (mask & ~reference.a_shape_mask(n, sink, local + 2 * block)).any()  # within a block of it


def test_block_sparse_keeps_diagonal_and_first_blocks_and_budget():
    gen = torch.Generator().manual_seed(3)
    n, block, budget = 160, 16, 3
    q, k = torch.randn(n, 1, 32, generator=gen), torch.randn(n, 1, 32, generator=gen)
    index = estimate_index(q, k, 0.2, [HeadPattern("block_sparse", blocks=budget, rescue=0)], block)
    nq = index.blocks.shape[1]
    assert index.block_count[0].tolist() == [min(i + 1, budget) for i in range(nq)]
    for i in range(nq):
        listed = set(index.blocks[0, i, : index.block_count[0, i]].tolist())
        assert {0, i} <= listed


def test_rescue_finds_a_key_salient_only_to_middle_queries():
    """A key that only queries 100..160 of 256 want: invisible to the last 32 queries."""
    gen = torch.Generator().manual_seed(4)
    n, block, needle = 256, 16, 37
    q, k = torch.randn(n, 1, 32, generator=gen) * 0.3, torch.randn(n, 1, 32, generator=gen) * 0.3
    q[:, 0, 0] = 0.0
    q[100:160, 0, 0] = 6.0
    k[needle, 0, 0] = 6.0
    plain = HeadPattern("vertical_slash", vertical=8, slash=32, sink=4, local=16, rescue=0)
    for pattern, found in ((plain, False), (HeadPattern(**{**plain.__dict__, "rescue": 1}), True)):
        mask = index_to_mask(estimate_index(q, k, 0.2, [pattern], block, last_q=32))
        assert bool(mask[0, 100:160, needle].all()) is found
