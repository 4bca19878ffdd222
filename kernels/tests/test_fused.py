"""Fused decoder-layer glue (RMSNorm, residual add + RMSNorm, rotary, SiLU- and tanh-GELU-and-mul) against
the torch twins.

Rotary rounds exactly where torch does, so it must match bit for bit; the norm's reduction order and
exp's last bits may differ, so those compare within about one unit in the last place of the dtype.
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
EXACT = dict(rtol=0, atol=0)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _fused_qkv(tokens: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as the model makes them: views of one projection, token stride wider than a head block."""
    num_q, num_kv = heads
    qkv = _randn(tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    return q.view(tokens, num_q, head_dim), k.view(tokens, num_kv, head_dim), v.view(tokens, num_kv, head_dim)


def _cos_sin(tokens: int, head_dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D] as RotaryEmbedding.cos_sin builds them, at scattered positions."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _fused():
    from tgserve.kernels import fused  # imports Triton: only inside tests that got the device fixture

    return fused


def _on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [to_device(t, device) for t in tensors]  # views stay views on the GPU


# ---- RMSNorm ----

NORM_SHAPES = [(1, 4096), (3, 576), (17, 576), (17, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", NORM_SHAPES)
def test_rms_norm(device, dtype, tokens, hidden):
    x = _randn(tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=2)
    got = _fused().rms_norm(*_on(device, x, weight), 1e-6)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), reference.rms_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_rms_norm_promotes_like_torch(device, x_dtype, w_dtype):
    """The cast to x's dtype comes before the weight; the product takes the promoted dtype."""
    x, weight = _randn(5, 576, dtype=x_dtype, seed=3), _randn(576, dtype=w_dtype, seed=4)
    got = _fused().rms_norm(*_on(device, x, weight), 1e-5).cpu()
    want = reference.rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[x_dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_fused_projection(device, dtype):
    """Qwen3 normalises each head of q and k, strided views of the QKV output, before rotary."""
    q, k, _ = _fused_qkv(3, (9, 3), 64, dtype, seed=5)
    weight = _randn(64, dtype=dtype, seed=6)
    for heads in (q, k):
        got = _fused().rms_norm(*_on(device, heads, weight), 1e-6).cpu()
        assert got.shape == heads.shape
        torch.testing.assert_close(got, reference.rms_norm(heads, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", NORM_SHAPES)
def test_fused_add_rms_norm(device, dtype, tokens, hidden):
    x = _randn(tokens, hidden, dtype=dtype, seed=7)
    residual = _randn(tokens, hidden, dtype=dtype, seed=8, scale=4.0)
    weight = _randn(hidden, dtype=dtype, seed=9)
    inputs = _on(device, x, residual, weight)
    before = [t.clone() for t in inputs]
    normed, new_residual = _fused().fused_add_rms_norm(*inputs, 1e-6)
    want_normed, want_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual.cpu(), want_residual, **EXACT)
    torch.testing.assert_close(normed.cpu(), want_normed, **TOL[dtype])
    assert all(torch.equal(a, b) for a, b in zip(inputs, before)), "inputs must stay untouched"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_in_place(device, dtype):
    """in_place writes the two outputs over x and residual, with the values the copy would have."""
    x = _randn(17, 576, dtype=dtype, seed=23)
    residual = _randn(17, 576, dtype=dtype, seed=24, scale=4.0)
    weight = _randn(576, dtype=dtype, seed=25)
    want_normed, want_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    x_dev, residual_dev, weight_dev = _on(device, x, residual, weight)
    normed, new_residual = _fused().fused_add_rms_norm(x_dev, residual_dev, weight_dev, 1e-6, in_place=True)
    assert normed.data_ptr() == x_dev.data_ptr() and new_residual.data_ptr() == residual_dev.data_ptr()
    torch.testing.assert_close(new_residual.cpu(), want_residual, **EXACT)
    torch.testing.assert_close(normed.cpu(), want_normed, **TOL[dtype])


def test_fused_add_rms_norm_in_place_falls_back_where_outputs_do_not_fit(device):
    """A strided x, or a weight that promotes the output's dtype, gets new outputs; the inputs stay."""
    wide = _randn(5, 128, dtype=torch.float16, seed=26)
    residual = _randn(5, 64, dtype=torch.float16, seed=27)
    for x, weight in ((wide[:, :64], _randn(64, dtype=torch.float16, seed=28)),
                      (wide[:, 64:].contiguous(), _randn(64, dtype=torch.float32, seed=29))):  # fmt: skip
        inputs = _on(device, x, residual, weight)
        before = [t.clone() for t in inputs]
        normed, new_residual = _fused().fused_add_rms_norm(*inputs, 1e-6, in_place=True)
        assert normed.data_ptr() != inputs[0].data_ptr() and new_residual.data_ptr() != inputs[1].data_ptr()
        assert all(torch.equal(a, b) for a, b in zip(inputs, before)), "inputs must stay untouched"
        want_normed, want_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
        torch.testing.assert_close(new_residual.cpu(), want_residual, **EXACT)
        torch.testing.assert_close(normed.cpu(), want_normed, **TOL[torch.float16])


# ---- rotary ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("flat_cos", [False, True])
def test_rotary(device, dtype, tokens, head_dim, flat_cos):
    q, k, _ = _fused_qkv(tokens, (9, 3), head_dim, dtype, seed=tokens)
    cos, sin = _cos_sin(tokens, head_dim, dtype, seed=tokens + 1)
    if flat_cos:
        cos, sin = cos[:, 0], sin[:, 0]
    got_q, got_k = _fused().rotary(*_on(device, q, k, cos, sin))
    want_q, want_k = reference.rotary(q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q.cpu(), want_q, **EXACT)
    torch.testing.assert_close(got_k.cpu(), want_k, **EXACT)


def test_rotary_into_rows_of_a_larger_tensor(device):
    """`out`: the rotated rows land in the given rows of whole-step tensors, the others untouched."""
    q, k, _ = _fused_qkv(5, (4, 2), 64, torch.float32, seed=20)
    cos, sin = _cos_sin(5, 64, torch.float32, seed=21)
    whole_q = torch.full((9, 4, 64), float("nan"), device=device)
    whole_k = torch.full((9, 2, 64), float("nan"), device=device)
    got = _fused().rotary(*_on(device, q, k, cos, sin), out=(whole_q[2:7], whole_k[2:7]))
    want_q, want_k = reference.rotary(q, k, cos, sin)
    assert got[0].data_ptr() == whole_q[2:7].data_ptr()
    torch.testing.assert_close(whole_q[2:7].cpu(), want_q, **EXACT)
    torch.testing.assert_close(whole_k[2:7].cpu(), want_k, **EXACT)
    assert whole_q[:2].isnan().all() and whole_q[7:].isnan().all() and whole_k[7:].isnan().all()


def test_rotary_arbitrary_cos_sin(device):
    """Halves of cos/sin that differ (not RoPE's own tables) must still land on the right dims."""
    q, k, _ = _fused_qkv(4, (2, 1), 64, torch.float32, seed=10)
    cos, sin = _randn(4, 1, 64, dtype=torch.float32, seed=11), _randn(4, 1, 64, dtype=torch.float32, seed=12)
    got_q, got_k = _fused().rotary(*_on(device, q, k, cos, sin))
    want_q, want_k = reference.rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q.cpu(), want_q, **EXACT)
    torch.testing.assert_close(got_k.cpu(), want_k, **EXACT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,head_dim", [(1, 128), (5, 64), (3, 96)])
def test_rotary_with_head_norms(device, dtype, tokens, head_dim):
    """Qwen3's per-head RMSNorm of queries and keys in the rotary's launch: the norms' twins, then
    the rotary's, within the norm's reduction order (then the rotation rounds exactly as torch)."""
    q, k, _ = _fused_qkv(tokens, (9, 3), head_dim, dtype, seed=30 + tokens)
    cos, sin = _cos_sin(tokens, head_dim, dtype, seed=31)
    q_weight, k_weight = _randn(head_dim, dtype=dtype, seed=32), _randn(head_dim, dtype=dtype, seed=33)
    got_q, got_k = _fused().rotary(
        *_on(device, q, k, cos, sin), qk_norm=(*_on(device, q_weight, k_weight), 1e-6)
    )
    want_q, want_k = reference.rotary(
        reference.rms_norm(q, q_weight, 1e-6), reference.rms_norm(k, k_weight, 1e-6), cos, sin
    )
    torch.testing.assert_close(got_q.cpu(), want_q, **TOL[dtype])
    torch.testing.assert_close(got_k.cpu(), want_k, **TOL[dtype])
    # and the CPU path of the dispatch (norms, then rotary) gives the twins' values exactly
    for got, want in zip(
        dispatch.rotary(q, k, cos, sin, qk_norm=(q_weight, k_weight, 1e-6)), (want_q, want_k)
    ):
        torch.testing.assert_close(got, want, **EXACT)


# ---- gated activations: SiLU- and tanh-GELU-and-mul (one kernel, the activation a constexpr) ----

# Per activation: the gate values that saturate it both ways (exp overflow must give silu = -0, x;
# tanh saturates to -1, 1), and the seeds of the random rows and of the strided ones.
GATES = {"silu": (80.0, 13, 14), "gelu_tanh": (40.0, 9, 10)}


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 96), (3, 2500), (17, 1000)])
def test_gated_activation_and_mul(device, gate, dtype, tokens, inter):
    extreme, seed, _ = GATES[gate]
    gate_up = _randn(tokens, 2 * inter, dtype=dtype, seed=seed, scale=3.0)
    gate_up[0, :3] = torch.tensor([-extreme, extreme, 0.0]).to(dtype)
    got = getattr(_fused(), f"{gate}_and_mul")(to_device(gate_up, device)).cpu()
    assert got.shape == (tokens, inter) and torch.isfinite(got).all()
    torch.testing.assert_close(got, getattr(reference, f"{gate}_and_mul")(gate_up), **TOL[dtype])


@pytest.mark.parametrize("gate", list(GATES))
def test_gated_activation_and_mul_strided_rows(device, gate):
    wide = _randn(5, 3 * 200, dtype=torch.float16, seed=GATES[gate][2])
    gate_up = wide[:, 100:500]  # token stride 600, not 400
    got = getattr(_fused(), f"{gate}_and_mul")(to_device(gate_up, device)).cpu()
    torch.testing.assert_close(got, getattr(reference, f"{gate}_and_mul")(gate_up), **TOL[torch.float16])


def test_empty_batches(device):
    fused = _fused()
    x, w = torch.zeros(0, 64, device=device), torch.ones(64, device=device)
    assert fused.rms_norm(x, w, 1e-6).shape == (0, 64)
    assert [t.shape for t in fused.fused_add_rms_norm(x, x, w, 1e-6)] == [(0, 64), (0, 64)]
    q, k = torch.zeros(0, 4, 16, device=device), torch.zeros(0, 2, 16, device=device)
    cos = torch.zeros(0, 1, 16, device=device)
    assert [t.shape for t in fused.rotary(q, k, cos, cos)] == [(0, 4, 16), (0, 2, 16)]
    assert fused.silu_and_mul(torch.zeros(0, 32, device=device)).shape == (0, 16)
    assert fused.gelu_tanh_and_mul(torch.zeros(0, 32, device=device)).shape == (0, 16)


def test_cpu_dispatch_is_the_twin():
    """CPU tensors never reach Triton: the entry points return the twins' exact results."""
    x, r, w = (_randn(3, 64, dtype=torch.float32, seed=s) for s in (15, 16, 17))
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    want = reference.fused_add_rms_norm(x, r, w, 1e-6)
    assert all(map(torch.equal, dispatch.fused_add_rms_norm(x, r, w, 1e-6), want))
    q, k, _ = _fused_qkv(3, (4, 2), 16, torch.float32, seed=18)
    cos, sin = _cos_sin(3, 16, torch.float32, seed=19)
    assert all(map(torch.equal, dispatch.rotary(q, k, cos, sin), reference.rotary(q, k, cos, sin)))
    assert torch.equal(dispatch.silu_and_mul(x), reference.silu_and_mul(x))


# ---- CUDA, bf16, Llama-3-8B sizes (the interpreter gets bf16 wrong) ----


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_norms_bf16_gpu(tokens):
    dt, dev = torch.bfloat16, "cuda"
    x, r = _randn(tokens, 4096, dtype=dt, seed=20).to(dev), _randn(tokens, 4096, dtype=dt, seed=21).to(dev)
    w = _randn(4096, dtype=dt, seed=22).to(dev)
    torch.testing.assert_close(dispatch.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL[dt])
    normed, residual = dispatch.fused_add_rms_norm(x, r, w, 1e-5)
    want_normed, want_residual = reference.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(residual, want_residual, **EXACT)
    torch.testing.assert_close(normed, want_normed, **TOL[dt])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rotary_bf16_gpu(tokens):
    q, k, _ = (t.cuda() for t in _fused_qkv(tokens, (32, 8), 128, torch.bfloat16, seed=23))
    cos, sin = (t.cuda() for t in _cos_sin(tokens, 128, torch.bfloat16, seed=24))
    for got, want in zip(dispatch.rotary(q, k, cos, sin), reference.rotary(q, k, cos, sin)):
        torch.testing.assert_close(got, want, **EXACT)
    norms = [
        t.cuda()
        for t in (_randn(128, dtype=torch.bfloat16, seed=25), _randn(128, dtype=torch.bfloat16, seed=26))
    ]
    normed = reference.rms_norm(q, norms[0], 1e-6), reference.rms_norm(k, norms[1], 1e-6)
    for got, want in zip(
        dispatch.rotary(q, k, cos, sin, qk_norm=(*norms, 1e-6)), reference.rotary(*normed, cos, sin)
    ):
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_silu_and_mul_bf16_gpu(tokens):
    gate_up = _randn(tokens, 2 * 14336, dtype=torch.bfloat16, seed=25, scale=3.0).cuda()
    got = dispatch.silu_and_mul(gate_up)
    torch.testing.assert_close(got, reference.silu_and_mul(gate_up), **TOL[torch.bfloat16])
