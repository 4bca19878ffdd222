"""Triton router for mixture-of-experts decode: a token's softmax, top k and renormalisation (or
gpt-oss's top k logits and their softmax) in one launch.

Twins: `moe_routing.route`, `route_top_logits`. In torch the router is four or five kernels a layer
(softmax, a top-k that sorts, a sum and a divide); at batch 1 they are all launch: on an H200 the
top-k alone took ~8 us a layer for Qwen3-30B-A3B (128 experts), more than reading its router
weights. One program a token: the logits row in registers, k rounds of "take the largest, mask it
out" (the first index on ties), the weights in float32 as the twins return them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import pdl, wait_for_inputs

# Tokens up to which the kernel routes (decode steps); longer steps' routing is the twins' (torch).
MAX_TOKENS = 64


@triton.jit
def _router_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + token * stride_t + experts, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:  # softmax over every expert in float32, then its top k (Mixtral, Qwen MoE)
        e = tl.exp(x - tl.max(x, axis=0))
        x = e / tl.sum(e, axis=0)
    slots = tl.arange(0, TOP_K)
    top = tl.zeros([TOP_K], tl.float32)
    ids = tl.zeros([TOP_K], tl.int64)
    # Chosen by a mask, not by values: a row whose logits are not finite (a padding row of a
    # bucketed step can hold NaN) still picks k distinct experts in range, NaN ranked lowest.
    open_ = valid
    for slot in tl.static_range(TOP_K):
        ranked = tl.where(open_ & (x == x), x, float("-inf"))
        best = tl.max(ranked, axis=0)
        # the first index of the largest
        at = tl.min(tl.where(open_ & (ranked == best), experts, BLOCK_E), axis=0)
        top = tl.where(slots == slot, best, top)
        ids = tl.where(slots == slot, at.to(tl.int64), ids)
        open_ = open_ & (experts != at)
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            top = top / tl.sum(top, axis=0)
        if ROUND:  # Qwen's MoE rounds the weights to the model's dtype (the logits'), kept in float32
            top = top.to(logits_ptr.dtype.element_ty).to(tl.float32)
    else:  # gpt-oss: a softmax over the top logits, in the logits' dtype as transformers computes it
        e = tl.exp(top - tl.max(top, axis=0))
        top = (e / tl.sum(e, axis=0)).to(logits_ptr.dtype.element_ty).to(tl.float32)
    tl.store(weights_ptr + token * TOP_K + slots, top)
    tl.store(ids_ptr + token * TOP_K + slots, ids)


def routes_in_one_launch(logits: torch.Tensor, top_k: int) -> bool:
    """Decode-sized steps with k a power of two (Triton's vectors) and unit-stride logits rows."""
    return (
        logits.dim() == 2
        and 0 < logits.shape[0] <= MAX_TOKENS
        and top_k == triton.next_power_of_2(top_k)
        and top_k <= logits.shape[1]
        and logits.stride(1) == 1
    )


def route_triton(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool = False,
    softmax_first: bool = True,
    round_to_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) of router logits [T, E]: `route` (softmax
    first) or, with softmax_first=False, `route_top_logits`. round_to_logits (softmax first): the
    weights rounded to the logits' dtype, still float32, as the expert kernels read them: the
    model's cast and the kernels' cast back to float32 are two launches a layer at batch 1."""
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    _router_kernel[(tokens,)](
        logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts), SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize,
        ROUND=round_to_logits, num_warps=1 if num_experts <= 256 else 4, **pdl(logits),
    )  # fmt: skip
    return weights, ids
