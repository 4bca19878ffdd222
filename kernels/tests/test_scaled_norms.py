"""RMSNorms that scale in float32 (kernels/scaled_norms.py: Gemma's, OLMo's kind) and Gemma's norm
after a sublayer added to the residual stream (with the next norm), against the torch twins; the
tanh-GELU gating's kernel tests are beside SiLU's in test_fused.py.

The residual add rounds where torch does; the norm's reduction order may differ, so normed outputs
compare within about one unit in the last place.
"""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import dispatch, reference
from tgserve.kernels.testing import to_device

DTYPES = [torch.float32, torch.float16]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
SHAPES = [(1, 2304), (3, 576), (17, 3584)]


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _norms():
    from tgserve.kernels import scaled_norms  # imports Triton: only inside tests that got the device fixture

    return scaled_norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_gemma_rms_norm(device, dtype, tokens, hidden):
    """x / rms(x) * (1 + weight): weights near zero, as Gemma's are stored."""
    x = _randn(tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=2, scale=0.3)
    got = _norms().gemma_rms_norm(to_device(x, device), to_device(weight, device), 1e-6)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), reference.gemma_rms_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_float_scaled_rms_norm(device, dtype, tokens, hidden):
    """(weight * (x / rms(x))).to(dtype): OLMo's RMSNorm, the product in float32."""
    x = _randn(tokens, hidden, dtype=dtype, seed=21, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=22)
    got = _norms().float_scaled_rms_norm(to_device(x, device), to_device(weight, device), 1e-6)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), reference.float_scaled_rms_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_per_head_of_a_fused_projection(device, dtype):
    """Gemma 3 norms each head of q and k: strided views of the QKV output."""
    qkv = _randn(3, (8 + 2 * 4) * 32, dtype=dtype, seed=3)
    q = qkv[:, : 8 * 32].view(3, 8, 32)
    weight = _randn(32, dtype=dtype, seed=4, scale=0.3)
    got = _norms().gemma_rms_norm(to_device(q, device), to_device(weight, device), 1e-6).cpu()
    assert got.shape == q.shape
    torch.testing.assert_close(got, reference.gemma_rms_norm(q, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
@pytest.mark.parametrize("with_next", [False, True])
def test_gemma_norm_add(device, dtype, tokens, hidden, with_next):
    """residual + norm(x), and that sum normed by the next weight; the inputs untouched."""
    x = _randn(tokens, hidden, dtype=dtype, seed=5, scale=2.0)
    residual = _randn(tokens, hidden, dtype=dtype, seed=6, scale=4.0)
    weight, next_weight = (_randn(hidden, dtype=dtype, seed=s, scale=0.3) for s in (7, 8))
    nxt = next_weight if with_next else None
    inputs = [to_device(t, device) for t in (x, residual, weight)]
    before = [t.clone() for t in inputs]
    hidden_out, normed = _norms().gemma_norm_add(
        *inputs, 1e-6, None if nxt is None else to_device(nxt, device)
    )
    want_hidden, want_normed = reference.gemma_norm_add(x, residual, weight, 1e-6, nxt)
    torch.testing.assert_close(hidden_out.cpu(), want_hidden, **TOL[dtype])
    if with_next:
        torch.testing.assert_close(normed.cpu(), want_normed, **TOL[dtype])
    else:
        assert normed is None
    assert all(torch.equal(a, b) for a, b in zip(inputs, before)), "inputs must stay untouched"


def test_empty_batches(device):
    norms = _norms()
    x, w = torch.zeros(0, 64, device=device), torch.zeros(64, device=device)
    assert norms.gemma_rms_norm(x, w, 1e-6).shape == norms.float_scaled_rms_norm(x, w, 1e-6).shape == (0, 64)
    hidden, normed = norms.gemma_norm_add(x, x, w, 1e-6, w)
    assert hidden.shape == normed.shape == (0, 64)


def test_cpu_dispatch_is_the_twin():
    """CPU tensors never reach Triton; the twins are transformers' Gemma ops (the model's parity
    with transformers rests on them)."""
    from transformers.activations import ACT2FN

    x, r, w, w2 = (_randn(3, 64, dtype=torch.float32, seed=s) for s in (11, 12, 13, 14))
    assert torch.equal(dispatch.gemma_rms_norm(x, w, 1e-6), reference.gemma_rms_norm(x, w, 1e-6))
    assert torch.equal(
        dispatch.float_scaled_rms_norm(x, w, 1e-6), reference.float_scaled_rms_norm(x, w, 1e-6)
    )
    got = dispatch.gemma_norm_add(x, r, w, 1e-6, w2)
    want = reference.gemma_norm_add(x, r, w, 1e-6, w2)
    assert all(map(torch.equal, got, want))
    assert torch.equal(got[0], r + reference.gemma_rms_norm(x, w, 1e-6))
    gate, up = x.split(32, dim=-1)
    assert torch.equal(dispatch.gelu_tanh_and_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_gemma_glue_bf16_gpu(tokens):
    """Gemma-2-9B's sizes in bf16 on a GPU (the interpreter gets bf16 wrong)."""
    dt, dev = torch.bfloat16, "cuda"
    x, r = _randn(tokens, 3584, dtype=dt, seed=15).to(dev), _randn(tokens, 3584, dtype=dt, seed=16).to(dev)
    w, w2 = (
        _randn(3584, dtype=dt, seed=17, scale=0.3).to(dev),
        _randn(3584, dtype=dt, seed=18, scale=0.3).to(dev),
    )
    torch.testing.assert_close(
        dispatch.gemma_rms_norm(x, w, 1e-6), reference.gemma_rms_norm(x, w, 1e-6), **TOL[dt]
    )
    for got, want in zip(
        dispatch.gemma_norm_add(x, r, w, 1e-6, w2), reference.gemma_norm_add(x, r, w, 1e-6, w2)
    ):
        torch.testing.assert_close(got, want, **TOL[dt])
    gate_up = _randn(tokens, 2 * 14336, dtype=dt, seed=19, scale=3.0).to(dev)
    torch.testing.assert_close(
        dispatch.gelu_tanh_and_mul(gate_up), reference.gelu_tanh_and_mul(gate_up), **TOL[dt]
    )
