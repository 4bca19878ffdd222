"""fp8 projections (kernels/fp8.py): per-row quantization, and the product against the dequantized one.

The Triton quantization kernel is held to its torch twin bit for bit on a GPU only: Triton's CPU
interpreter converts float32 to e4m3 wrongly (it turns -125.87 into -64, where the nearest e4m3
values are -128 and -120).
"""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import dispatch
from tgserve.kernels.fp8 import fp8_linear
from tgserve.kernels.fp8_format import FP8, FP8_MAX, quantize_rows, tensor_scale


def _randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def test_rows_scale_to_the_largest_magnitude_and_round_to_e4m3() -> None:
    x = _randn(4, 96, seed=0, scale=3.0)
    x[2] = 0.0  # an all-zero row quantizes to zeros, without nan
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (4, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 3]], torch.full((3,), FP8_MAX))
    assert torch.equal(q[2].float(), torch.zeros(96))
    # e4m3 has 3 mantissa bits: each value within half a step, 1/16 of its magnitude (or subnormal).
    back = q.float() * scale
    assert ((back - x).abs() <= x.abs() / 16 + scale * 2.0**-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_equals_the_dequantized_operands_product(dtype: torch.dtype) -> None:
    x = _randn(7, 128, seed=1, dtype=dtype)
    w_q, w_scale = quantize_rows(_randn(48, 128, seed=2, scale=0.05))
    bias = _randn(48, seed=3, dtype=dtype)
    got = fp8_linear(x, w_q, w_scale, bias)
    x_q, x_scale = quantize_rows(x)
    # Products of e4m3 values are exact in float32 and 128 of them sum with float32's rounding only.
    want = ((x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()).t()).to(torch.bfloat16)
    want = want.to(dtype) + bias
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


def test_dispatch_takes_the_fp8_product_when_given_a_scale_and_handles_no_rows() -> None:
    w_q, w_scale = quantize_rows(_randn(32, 64, seed=4))
    x = _randn(3, 64, seed=5)
    assert torch.equal(dispatch.linear(x, w_q, None, w_scale), fp8_linear(x, w_q, w_scale))
    assert dispatch.linear(x[:0], w_q, None, w_scale).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (3, 576), (17, 14336), (256, 4096), (5, 1536), (1001, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("given", [None, "tensor", "rows"])
def test_triton_quantization_matches_torch_bit_for_bit_gpu(
    shape: tuple[int, int], dtype: torch.dtype, given: str | None
) -> None:
    from tgserve.kernels.fp8_rows import quantize_rows_triton

    x = _randn(*shape, seed=6, scale=4.0, dtype=dtype).cuda()
    x[0, : shape[1] // 2] = 0.0
    if shape[0] > 2:
        x[2] = 0.0
    given_scales = {"tensor": tensor_scale(x), "rows": torch.rand(shape[0], 1, device="cuda") + 0.01}
    scale = given_scales.get(given)
    q, got_scale = quantize_rows_triton(x, scale)
    q_ref, scale_ref = quantize_rows(x, scale)
    assert torch.equal(got_scale, scale_ref.expand_as(got_scale))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_tensor_scale_brings_the_largest_magnitude_to_448() -> None:
    x = _randn(64, 32, seed=9)
    x[5, 7] = -37.0  # the largest magnitude is a negative value
    scale = tensor_scale(x)
    assert scale.shape == (1, 1) and scale.item() == pytest.approx(37.0 / 448)
    q, _ = quantize_rows(x, scale)
    assert q.float().abs().max().item() == 448.0 and q[5, 7].item() == -448.0


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 300])
def test_gpu_product_is_the_dequantized_product_gpu(rows: int) -> None:
    """Up to 16 rows take kernels/fp8_gemv.py, more cuBLAS's fp8 product; both quantize x's rows."""
    x = _randn(rows, 1024, seed=7, dtype=torch.bfloat16)
    w_q, w_scale = quantize_rows(_randn(2048, 1024, seed=8, scale=0.02))
    got = fp8_linear(x.cuda(), w_q.cuda(), w_scale.cuda()).cpu()
    x_q, x_scale = quantize_rows(x)
    # The CPU's quantization is the GPU's, bit for bit.
    on_gpu = quantize_rows(x.cuda())
    assert torch.equal(on_gpu[0].cpu().view(torch.uint8), x_q.view(torch.uint8))
    assert torch.equal(on_gpu[1].cpu(), x_scale)
    want = ((x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()).t()).to(torch.bfloat16)
    # Exact products, float32 sums in some order, one rounding to bf16: at most a unit apart.
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
