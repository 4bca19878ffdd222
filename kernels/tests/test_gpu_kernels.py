"""GPU checks at realistic sizes with the flash-attention rule.

A kernel's error against an fp32 reference must be at most twice the error of the same
computation done by torch in the low-precision dtype, plus 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import argmax, dispatch, fused, gemv, kv_write, paged_decode, reference, triton_common
from tgserve.kernels.testing import make_paged_batch, max_abs_err

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


def _flash_rule(got: torch.Tensor, exact: torch.Tensor, low: torch.Tensor) -> None:
    assert torch.isfinite(got).all()
    kernel_err, torch_err = max_abs_err(got, exact), max_abs_err(low, exact)
    assert kernel_err <= 2 * torch_err + 1e-3, (kernel_err, torch_err)


def _paged_refs(batch, scale, window=None, softcap=None):
    args = (batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale,
            window, softcap)  # fmt: skip
    return reference.paged_attention(*args), reference.paged_attention(*args, upcast=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((32, 32), 64), ((16, 1), 256), ((8, 1), 128)])
@pytest.mark.parametrize("window,softcap", [(None, None), (1000, None), (None, 30.0)])
def test_decode_gpu(dtype, heads, head_dim, window, softcap):
    seq_lens = [1, 15, 16, 17, 300, 1024, 4096, 2500]
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, *heads, head_dim, 16, dtype, "cuda", seed=1)
    exact, low = _paged_refs(batch, head_dim**-0.5, window, softcap)
    got = dispatch.paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5,
                                window, softcap)  # fmt: skip
    _flash_rule(got, exact, low)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (16, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (700, 50.0)])
def test_paged_prefill_gpu(dtype, heads, window, softcap):
    q_lens, seq_lens = [1000, 1, 513, 64, 0, 2048], [1000, 3000, 1537, 64, 10, 2100]
    batch = make_paged_batch(q_lens, seq_lens, *heads, 128, 16, dtype, "cuda", seed=2)
    exact, low = _paged_refs(batch, 0.088, window, softcap)
    got = dispatch.paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc,
                                 batch.seq_lens, 0.088, window, softcap)  # fmt: skip
    _flash_rule(got, exact, low)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[4096], [100, 2000, 1, 777], [3000, 100, 2048, 1, 40]])
@pytest.mark.parametrize("cudnn_from", [None, 1024])
def test_dense_prefill_gpu(dtype, lens, cudnn_from, monkeypatch):
    """One sequence and long ones take SDPA (flash first; cuDNN first from CUDNN_MIN_TOKENS, here
    lowered to reach it), short ones the Triton varlen kernel."""
    if cudnn_from is not None:
        monkeypatch.setattr(dispatch, "CUDNN_MIN_TOKENS", cudnn_from)
    gen = torch.Generator(device="cuda").manual_seed(3)
    total = sum(lens)
    q = torch.randn(total, 32, 128, device="cuda", generator=gen, dtype=dtype)
    k, v = (torch.randn(total, 8, 128, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    exact = reference.varlen_attention(q, k, v, cu, 0.088)
    low = reference.varlen_attention(q, k, v, cu, 0.088, upcast=False)
    cu_cpu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    _flash_rule(dispatch.dense_prefill(q, k, v, cu, max(lens), 0.088, cu_seqlens_cpu=cu_cpu), exact, low)
    from tgserve.kernels.paged_prefill import varlen_prefill

    _flash_rule(varlen_prefill(q, k, v, cu, 0.088), exact, low)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_kernel_gpu(dtype):
    from tgserve.kernels.sparse.attention import estimate_index
    from tgserve.kernels.sparse.config import HeadPattern
    from tgserve.kernels.sparse.index import index_to_mask
    from tgserve.kernels.sparse.kernel import sparse_attention_kernel

    gen = torch.Generator(device="cuda").manual_seed(4)
    n = 4096
    q = torch.randn(n, 8, 128, device="cuda", generator=gen, dtype=dtype)
    k, v = (torch.randn(n, 2, 128, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    patterns = [HeadPattern(vertical=200, slash=600), HeadPattern("a_shape", sink=64, local=512),
                HeadPattern("block_sparse", blocks=8), HeadPattern("dense")] * 2  # fmt: skip
    index = estimate_index(q, k, 0.088, patterns, 64, use_triton=True)
    mask = index_to_mask(index)
    exact = reference.masked_attention(q, k, v, mask, 0.088)
    low = reference.masked_attention(q, k, v, mask, 0.088, upcast=False)
    _flash_rule(sparse_attention_kernel(q, k, v, index, 0.088), exact, low)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_prefill_goes_sparse_in_place_gpu(dtype):
    """The engine's call: q/k/v are views of one fused projection and a long prompt sits between
    short ones; the long one is computed sparse straight into its rows of the step's output."""
    from tgserve.kernels.sparse.attention import estimate_index
    from tgserve.kernels.sparse.config import SparseConfig
    from tgserve.kernels.sparse.index import index_to_mask

    gen = torch.Generator(device="cuda").manual_seed(5)
    lens = [100, 4096, 7]
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    qkv = torch.randn(starts[-1], 48, 128, device="cuda", generator=gen, dtype=dtype)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    config = SparseConfig(min_seq_len=2048)
    cu = torch.tensor(starts, device="cuda", dtype=torch.int32)
    got = dispatch.fresh_prefill(q, k, v, cu, starts, 0.088, sparse=config, layer=0)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the references' own layout
    for a, b in zip(starts, starts[1:]):
        if b - a >= config.min_seq_len:
            patterns = config.head_patterns(0, 32)
            index = estimate_index(q[a:b], k[a:b], 0.088, patterns, 64, 64, use_triton=True)
            args = (q[a:b], k[a:b], v[a:b], index_to_mask(index), 0.088)
            exact, low = reference.masked_attention(*args), reference.masked_attention(*args, upcast=False)
        else:
            one = torch.tensor([0, b - a], device="cuda", dtype=torch.int32)
            exact = reference.varlen_attention(q[a:b], k[a:b], v[a:b], one, 0.088)
            low = reference.varlen_attention(q[a:b], k[a:b], v[a:b], one, 0.088, upcast=False)
        _flash_rule(got[a:b], exact, low)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_gpu(dtype):
    cache = torch.zeros(2, 64, 16, 8, 128, device="cuda", dtype=dtype)
    key, value = (torch.randn(300, 8, 128, device="cuda", dtype=dtype) for _ in range(2))
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    expected = cache.clone()
    reference.write_kv(key, value, expected, slots)
    dispatch.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


def _decode_layers(x, residual, w, cache, tables, seq_lens, slot, cos, sin, layers=6):
    """A batch-1 decode step's kernel chain (norms, projections, rotary, KV write, attention,
    SiLU, argmax) over `layers` layers: every Triton kernel of the chain reads its predecessor's
    output, so a launch that started reading too early changes the result."""
    heads, kv_heads, dim = 8, 2, 64
    for _ in range(layers):
        h, residual = fused.fused_add_rms_norm(x, residual, w["norm"], 1e-5)
        qkv = gemv.skinny_linear(h, w["qkv"]).view(1, heads + 2 * kv_heads, dim)
        q, k = fused.rotary(qkv[:, :heads], qkv[:, heads : heads + kv_heads], cos, sin)
        kv_write.write_kv(k, qkv[:, heads + kv_heads :], cache, slot)
        attn = paged_decode.paged_decode(q, cache, tables, seq_lens, dim**-0.5, max_seq_len=4096)
        h, residual = fused.fused_add_rms_norm(
            gemv.skinny_linear(attn.view(1, -1), w["o"]), residual, w["norm"], 1e-5
        )
        x = gemv.skinny_linear(fused.silu_and_mul(h @ w["gate_up"].T), w["down"])
    return x, argmax.argmax_rows(gemv.skinny_linear(x, w["head"]))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="sm_90+"
)
def test_programmatic_dependent_launch_chain_in_a_cuda_graph_gpu(monkeypatch):
    """The chain with PDL, captured in a CUDA graph and replayed, gives exactly the tokens and
    hidden states of the same chain captured with plain launches (graphs on both sides, so cuBLAS
    runs the same algorithms)."""
    assert triton_common.pdl(torch.empty(1, device="cuda"))["PDL"], "PDL is off on this GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, dtype = 512, torch.bfloat16

    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) / shape[-1] ** 0.5).to(dtype)

    w = {"norm": rand(hidden) + 1, "qkv": rand(12 * 64, hidden), "o": rand(hidden, 8 * 64),
         "gate_up": rand(2 * 1024, hidden), "down": rand(hidden, 1024), "head": rand(32000, hidden)}  # fmt: skip
    batch = make_paged_batch([1], [300], 8, 2, 64, 16, dtype, "cuda", seed=3)
    slot = (batch.block_tables[0, 299 // 16] * 16 + 299 % 16).view(1).long()
    cos, sin = (torch.rand(1, 64, device="cuda", generator=gen).to(dtype) for _ in range(2))
    x0, res0, cache0 = rand(1, hidden), rand(1, hidden), batch.kv_cache.clone()
    args = (batch.block_tables, batch.seq_lens, slot, cos, sin)

    def captured():
        cache = cache0.clone()
        _decode_layers(x0, res0, w, cache, *args)  # compile and warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.copy_(cache0)
            outputs = _decode_layers(x0, res0, w, cache, *args)
        return graph, outputs

    with monkeypatch.context() as plain:
        plain.setattr(triton_common, "_pdl_on", lambda index: False)
        plain_graph, want = captured()
        plain_graph.replay()
    graph, got = captured()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
