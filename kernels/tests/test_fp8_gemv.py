"""The fp8 product of a few rows on tensor cores (kernels/fp8_gemv.py) against the dequantized
operands' product in float64: 1 to 16 rows, ragged shapes, bias, strided rows, output dtypes.

e4m3 products are exact, so the kernel's errors are those of its sums and of the final rounding to
the output dtype. On an H200 the fp8 MMA adds within one instruction with about 14 bits (Triton's
wgmma): each output may be off by a few units of 2^-14 of its sum of absolute products, which
the tests allow (2^-12 of it), on top of the output dtype's rounding.
"""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels.fp8_format import quantize_rows
from tgserve.kernels.fp8_gemv import MAX_ROWS, fp8_gemv
from tgserve.kernels.testing import to_device


def _operands(rows: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 3.0
    w = torch.randn(n, k, generator=gen) / k**0.5
    return quantize_rows(x), quantize_rows(w), torch.randn(n, generator=gen)


def _want(x_q, x_scale, w_q, w_scale, bias=None) -> torch.Tensor:
    out = (x_q.double() @ w_q.double().t()) * x_scale.double() * w_scale.double().t()
    return out if bias is None else out + bias.double()


def _assert_close(got, x_q, x_scale, w_q, w_scale, bias=None) -> None:
    want = _want(x_q, x_scale, w_q, w_scale, bias)
    magnitude = _want(x_q.float().abs(), x_scale, w_q.float().abs(), w_scale)
    rounding = {torch.float32: 2**-23, torch.float16: 2**-11, torch.bfloat16: 2**-8}[got.dtype]
    error = (got.double().cpu() - want).abs()
    assert (error <= magnitude * 2**-12 + want.abs() * rounding).all(), float((error / magnitude).max())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(50, 100), (64, 256), (7, 1030)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_is_the_dequantized_product(device, out_dtype, rows, n, k, bias):
    (x_q, x_scale), (w_q, w_scale), b = _operands(rows, n, k, seed=rows * n + k)
    b = b if bias else None
    got = fp8_gemv(x_q.to(device), x_scale.to(device), w_q.to(device), w_scale.to(device),
                   None if b is None else b.to(device), out_dtype=out_dtype, config={"BLOCK_K": 64})  # fmt: skip
    assert got.dtype == out_dtype and got.shape == (rows, n)
    _assert_close(got, x_q, x_scale, w_q, w_scale, b)


def test_strided_rows_and_the_default_config(device):
    """Rows of a wider buffer (a view), through the default tile sizes."""
    (x_q, x_scale), (w_q, w_scale), _ = _operands(3, 300, 512, seed=9)
    wide = torch.zeros(3, 1024, dtype=x_q.dtype)
    wide[:, 256:768] = x_q
    got = fp8_gemv(to_device(wide[:, 256:768], device), x_scale.to(device), w_q.to(device), w_scale.to(device),
                   out_dtype=torch.float32)  # fmt: skip
    _assert_close(got, x_q, x_scale, w_q, w_scale)


def test_no_rows_and_too_many_rows(device):
    (x_q, x_scale), (w_q, w_scale), _ = _operands(MAX_ROWS + 1, 32, 64, seed=3)
    args = (w_q.to(device), w_scale.to(device))
    assert fp8_gemv(x_q[:0].to(device), x_scale[:0].to(device), *args).shape == (0, 32)
    with pytest.raises(AssertionError):
        fp8_gemv(x_q.to(device), x_scale.to(device), *args)
