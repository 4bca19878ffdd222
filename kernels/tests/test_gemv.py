"""The skinny linear kernel against F.linear: one to a few rows, bias, ragged shapes, strided rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgserve.kernels.gemv import skinny_linear
from tgserve.kernels.testing import max_abs_err, to_device

ATOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(50, 100), (4, 1030), (33, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(device, dtype, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x, w, b)
    got = skinny_linear(x.to(dtype).to(device), w.to(dtype).to(device), None if b is None else b.to(dtype).to(device),
                        config={"BLOCK_K": 64})  # fmt: skip
    assert got.dtype == dtype and got.shape == (rows, n)
    assert max_abs_err(got.float().cpu(), want) <= ATOL[dtype]


def test_strided_rows_and_default_config(device):
    """A row of a wider activation (a view), through the default tile sizes."""
    gen = torch.Generator().manual_seed(5)
    wide, w = torch.randn(1, 300, generator=gen), torch.randn(70, 200, generator=gen)
    x = wide[:, 50:250]
    assert max_abs_err(skinny_linear(to_device(x, device), w.to(device)).cpu(), F.linear(x, w)) <= 1e-4
