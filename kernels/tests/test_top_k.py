"""Selective decode's top-k by radix select (kernels/top_k.py) against torch.topk."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels.top_k import top_k_indices


@pytest.mark.parametrize("n,k", [(300, 1), (300, 37), (1000, 999), (257, 257)])
def test_the_k_largest_of_each_row(device, n, k):
    gen = torch.Generator().manual_seed(n + k)
    scores = torch.randn(2, 3, n, generator=gen) * torch.tensor([1.0, 1e-3, 1e4])[None, :, None]
    scores[0, 0, :20] = float("-inf")  # blocks that cannot be chosen
    scores[1, 1] = -scores[1, 1].abs()  # a row of negatives only
    got = top_k_indices(scores.to(device), k).cpu()
    assert got.shape == (2, 3, k)
    want = torch.topk(scores, k, dim=-1).values
    picked = scores.gather(-1, got)
    assert torch.equal(picked.sort(-1, descending=True).values, want)
    assert all(len(set(row.tolist())) == k for row in got.view(-1, k)), "no index twice"
    assert torch.equal(got, got.sort(-1).values), "in index order"


def test_ties_at_the_threshold_take_the_first(device):
    scores = torch.tensor([[5.0, 1.0, 3.0, 3.0, 3.0, 0.0, 3.0, 7.0]])
    assert top_k_indices(scores.to(device), 4).cpu().tolist() == [[0, 2, 3, 7]]
    assert top_k_indices(torch.zeros(1, 6, device=device), 2).cpu().tolist() == [[0, 1]]
