"""Mixture-of-experts kernels (kernels/moe.py) against their twin, and the grouping by expert."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import reference
from tgserve.kernels.moe import fused_moe_triton
from tgserve.kernels.moe_routing import ClampedSwiGLU, expert_blocks, route, route_top_logits


def _layer(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w_gate_up = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype)
    w_down = (0.2 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return x, w_gate_up, w_down, weights, ids


@pytest.fixture
def grouped_kernels(monkeypatch):
    """fused_moe_triton as the grouped kernels at every row count (a one-token step takes the GEMVs
    of moe_decode.py by default; they have their own tests)."""
    from tgserve.kernels import moe

    monkeypatch.setattr(moe, "ONE_TOKEN_GEMV", False)


@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [(1, 8, 2, 32, 48),  # a decode row: two experts of eight read
     (37, 8, 2, 40, 24),  # ragged hidden and intermediate sizes, several blocks an expert
     (5, 16, 4, 32, 32)],  # experts no row chose
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_experts_equal_the_twin(
    device, grouped_kernels, tokens, experts, top_k, hidden, inter, dtype
):
    x, w_gate_up, w_down, weights, ids = _layer(tokens, experts, top_k, hidden, inter, dtype, seed=tokens)
    want = reference.fused_moe(x, w_gate_up, w_down, weights, ids)
    got = fused_moe_triton(*(t.to(device) for t in (x, w_gate_up, w_down, weights, ids)))
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-5 if dtype == torch.float32 and device == "cpu" else 2e-3 * want.abs().max().item()
    assert (got.cpu().float() - want.float()).abs().max() <= tolerance


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 4, 32, 48), (23, 8, 2, 40, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpt_oss_experts_equal_the_twin(
    device, grouped_kernels, tokens, experts, top_k, hidden, inter, dtype
):
    """Biases on both projections and the clamped SwiGLU, with a limit low enough to clamp."""
    x, w_gate_up, w_down, _, _ = _layer(tokens, experts, top_k, hidden, inter, dtype, seed=tokens + 1)
    gen = torch.Generator().manual_seed(tokens)
    weights, ids = route_top_logits(torch.randn(tokens, experts, generator=gen), top_k)
    biases = (
        torch.randn(experts, 2 * inter, generator=gen).to(dtype),
        torch.randn(experts, hidden, generator=gen).to(dtype),
    )
    gating = ClampedSwiGLU(alpha=1.702, limit=1.5)
    want = reference.fused_moe(x.float(), w_gate_up.float(), w_down.float(), weights, ids,
                               tuple(b.float() for b in biases), gating)  # fmt: skip
    plain = reference.fused_moe(x.float(), w_gate_up.float(), w_down.float(), weights, ids)
    assert (want - plain).abs().max() > 0.1, "the biases and the gating must matter"
    on = [t.to(device) for t in (x, w_gate_up, w_down, weights, ids)]
    got = fused_moe_triton(*on, tuple(b.to(device) for b in biases), gating)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    assert (got.cpu().float() - want).abs().max() <= tolerance


@pytest.mark.parametrize(
    "experts,top_k,hidden,inter", [(8, 2, 32, 48), (16, 4, 40, 24), (6, 1, 17, 9), (12, 3, 20, 40)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_one_token_gemv_path_equals_the_twin(
    device, grouped_kernels, experts, top_k, hidden, inter, dtype, gpt_oss
):
    """One decode row's experts as GEMVs (moe_decode.py), ragged widths included, with gpt-oss's
    biases and clamped gating or without; the grouped kernels' output to within their rounding."""
    from tgserve.kernels.moe_decode import one_token_moe

    x, w_gate_up, w_down, weights, ids = _layer(1, experts, top_k, hidden, inter, dtype, seed=hidden)
    gen = torch.Generator().manual_seed(inter)
    biases = (
        torch.randn(experts, 2 * inter, generator=gen).to(dtype),
        torch.randn(experts, hidden, generator=gen).to(dtype),
    )
    extra = (biases, ClampedSwiGLU(alpha=1.702, limit=1.5)) if gpt_oss else (None, None)
    want = reference.fused_moe(x.float(), w_gate_up.float(), w_down.float(), weights, ids,
                               None if extra[0] is None else tuple(b.float() for b in extra[0]), extra[1])  # fmt: skip
    on = [t.to(device) for t in (x, w_gate_up, w_down, weights, ids)]
    on_biases = None if extra[0] is None else tuple(b.to(device) for b in extra[0])
    got = one_token_moe(*on, on_biases, extra[1])
    grouped = fused_moe_triton(*on, on_biases, extra[1])
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    assert (got.cpu().float() - want).abs().max() <= tolerance
    assert (got.cpu().float() - grouped.cpu().float()).abs().max() <= tolerance


def test_the_one_token_switch_routes_a_decode_row_to_the_gemv_path(device, monkeypatch):
    from tgserve.kernels import moe, moe_decode

    calls = []
    monkeypatch.setattr(moe_decode, "one_token_moe", lambda *args: calls.append(args) or args[0])
    one = [t.to(device) for t in _layer(1, 8, 2, 32, 48, torch.float32, seed=0)]
    monkeypatch.setattr(moe, "ONE_TOKEN_GEMV", False)
    moe.fused_moe_triton(*one)
    assert not calls, "off: the grouped kernels"
    monkeypatch.setattr(moe, "ONE_TOKEN_GEMV", True)
    moe.fused_moe_triton(*one)
    moe.fused_moe_triton(*(t.to(device) for t in _layer(3, 8, 2, 32, 48, torch.float32, seed=0)))
    assert len(calls) == 1, "on: one-token steps only"


def test_gpt_oss_routing_is_a_softmax_over_the_top_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route_top_logits(logits, 2)
    assert ids.tolist() == [[0, 1]] and torch.allclose(weights, torch.softmax(logits[:, :2], -1))


def _assignments_by_block(layout, ids: torch.Tensor) -> list[int]:
    """Every block's assignments, checked to be of the block's expert; unused blocks empty."""
    rows = layout.rows.view(layout.num_blocks, layout.block_m)
    flat = ids.flatten()
    seen = []
    for block, expert in zip(rows.tolist(), layout.block_expert.tolist(), strict=True):
        used = [r for r in block if r >= 0]
        if expert < 0:
            assert not used
            continue
        assert used and all(flat[r] == expert for r in used)
        seen += used
    return seen


def test_assignments_are_grouped_by_expert_in_whole_blocks():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [3, 1]])
    layout = expert_blocks(ids, num_experts=6, block_m=4)
    assert layout.num_blocks == -(-(ids.numel() + 6 * 3) // 4), "sized by the row count alone"
    assert sorted(_assignments_by_block(layout, ids)) == list(range(ids.numel())), "every assignment once"
    assert layout.block_expert.tolist()[:4] == [0, 1, 2, 3], "experts 4 and 5, unchosen, get no block"


def test_one_token_takes_a_block_an_expert_without_sorting():
    """Batch-1 decode: k blocks, one per chosen expert in slot order, each with its one row."""
    ids = torch.tensor([[5, 0, 3]])
    layout = expert_blocks(ids, num_experts=6, block_m=4)
    assert layout.num_blocks == 3 and layout.block_expert.tolist() == [5, 0, 3]
    assert _assignments_by_block(layout, ids) == [0, 1, 2]
    again = expert_blocks(torch.tensor([[1, 4, 2]]), num_experts=6, block_m=4)
    assert again.rows is layout.rows, "the rows of one token are built once, not every step"
    assert again.block_expert.tolist() == [1, 4, 2]


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(weights, torch.softmax(logits, -1)[:, :2])
    assert torch.allclose(route(logits, 2, renormalize=True)[0].sum(-1), torch.ones(1))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (3, 8, 2), (5, 60, 4), (2, 32, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_router_kernel_equals_the_twins(device, tokens, experts, top_k, dtype, renormalize):
    """Softmax first (Mixtral, Qwen MoE) or the top logits' softmax (gpt-oss): the same experts in
    the same order, weights within float32 rounding (60 experts: a row padded to 64)."""
    from tgserve.kernels.moe_router import route_triton

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)).to(dtype)
    for softmax_first in (True, False):
        if softmax_first:
            want = route(logits, top_k, renormalize)
        else:
            want = route_top_logits(logits, top_k)
        got = route_triton(logits.to(device), top_k, renormalize, softmax_first)
        assert torch.equal(got[1].cpu(), want[1])
        assert got[0].dtype == torch.float32
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-6)


def test_router_kernel_rounds_the_weights_to_the_logits_dtype_in_float32(device):
    """Qwen's MoE rounds its routing weights to the model's dtype: the kernel stores them so
    rounded, in float32, for the expert kernels to read without two casts."""
    from tgserve.kernels.moe_router import route_triton

    logits = torch.randn(3, 128, generator=torch.Generator().manual_seed(3)).half()
    weights, ids = route_triton(logits.to(device), 8, True, round_to_logits=True)
    want_weights, want_ids = route(logits, 8, True)
    assert weights.dtype == torch.float32 and torch.equal(ids.cpu(), want_ids)
    assert torch.equal(weights, weights.half().float()), "values of the logits' dtype"
    torch.testing.assert_close(weights.cpu(), want_weights.half().float(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("experts", [128, 60])
def test_router_kernel_picks_distinct_experts_in_range_from_logits_that_are_not_finite(device, experts):
    """A padding row of a bucketed step may hold NaN (or inf) logits: its ids must still name k
    distinct experts, or the expert GEMMs read past the weights (a CUDA graph run of Mixtral with
    padded steps hit an out-of-range index here)."""
    from tgserve.kernels.moe_router import route_triton

    logits = torch.randn(4, experts)
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    for softmax_first in (True, False):
        _, ids = route_triton(logits.to(device), 8, True, softmax_first)
        ids = ids.cpu()
        assert ids.min() >= 0 and ids.max() < experts
        assert all(len(set(row)) == 8 for row in ids.tolist()), ids


def test_router_dispatch_takes_the_kernel_only_for_decode_steps():
    from tgserve.kernels.moe_router import MAX_TOKENS, routes_in_one_launch

    assert routes_in_one_launch(torch.zeros(1, 128), 8)
    assert not routes_in_one_launch(torch.zeros(MAX_TOKENS + 1, 128), 8), "prompt steps: torch"
    assert not routes_in_one_launch(torch.zeros(1, 128), 6), "k not a power of two"
    assert not routes_in_one_launch(torch.zeros(1, 4), 8), "k past the experts"


@pytest.mark.gpu
def test_a_decode_step_replays_from_a_cuda_graph():
    """Nothing in the grouping depends on the data: a graph recorded for one routing replays
    another's."""
    x, w_gate_up, w_down, weights, ids = (t.cuda() for t in _layer(4, 16, 2, 64, 64, torch.bfloat16, seed=9))
    out = fused_moe_triton(x, w_gate_up, w_down, weights, ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w_gate_up, w_down, weights, ids)
    new_weights, new_ids = route(torch.randn(4, 16, device="cuda"), 2, renormalize=True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = reference.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert (out.float() - want.float()).abs().max() <= 2e-2 * want.abs().max()
