"""Two-stage argmax against torch.argmax: first index of the maximum, any width and dtype."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels.argmax import argmax_rows
from tgserve.kernels.testing import to_device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 1), (1, 1000), (3, 64), (5, 130), (2, 4099)])
def test_argmax_matches_torch(device, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    assert torch.equal(argmax_rows(x.to(device)).cpu(), x.float().argmax(dim=-1))


def test_ties_take_the_first_index_across_chunks(device):
    """Equal maxima in several chunks (64 entries each under the interpreter): the leftmost wins."""
    x = torch.zeros(4, 300)
    x[0, [250, 10, 130]] = 5.0
    x[1, [64, 63]] = 2.0  # a chunk edge
    x[2] = float("-inf")  # nothing allowed: index 0, as torch
    x[3, 299] = 1.0
    got = argmax_rows(x.to(device)).cpu()
    assert got.tolist() == [10, 63, 0, 299]
    assert torch.equal(got, x.argmax(dim=-1))


def test_strided_rows(device):
    """A row slice of a wider tensor (the sampler's logits may be a view)."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 200, generator=gen)
    view = wide[:, 20:170]
    assert torch.equal(argmax_rows(to_device(view, device)).cpu(), view.argmax(dim=-1))
