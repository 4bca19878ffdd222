"""Mixture-of-experts routing and the grouping of a step's rows by expert (torch, any device).

`route` is the router of Mixtral and the Qwen MoE models: softmax over every expert in float32,
the top k, optionally renormalised to sum to one; `route_top_logits` is gpt-oss's (the top k logits,
then a softmax over them), whose experts gate with `ClampedSwiGLU`. `expert_blocks` lays the step's (token, slot)
assignments out expert by expert in blocks of `block_m` rows, so that each block of the grouped
GEMMs (`moe.py`) reads one expert's weights; only experts some row chose get blocks. Every shape
depends on the step's row count alone (no host sync, nothing data-dependent), so a decode step
can be recorded in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) of router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router: the top k logits, then a softmax over those alone, in the logits' dtype
    (as transformers computes it), returned in float32 as `route`'s weights are."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype).float(), ids


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation in place of SiLU(gate) * up: with g = min(gate, limit) and
    u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass
class ExpertBlocks:
    """A step's assignments grouped by expert: block b holds rows[b * block_m : (b + 1) * block_m]
    (assignment t * k + slot, -1 = padding), all of expert block_expert[b] (-1: an unused block)."""

    rows: torch.Tensor  # int32 [num_blocks * block_m]
    block_expert: torch.Tensor  # int32 or int64 [num_blocks]
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the assignments of ids [T, k] by expert, each expert's padded to whole blocks.

    At most A + E * (block_m - 1) rows for A = T * k assignments: that bound sizes the layout, so
    its shape is fixed by T alone. One token (batch-1 decode) chose k distinct experts: a block
    each, in slot order, with neither the sort nor the counting (no launch, not ~20)."""
    if ids.shape[0] == 1:
        return _one_token_blocks(ids, block_m)
    flat = ids.flatten()
    count = flat.numel()
    device = ids.device
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=device)
    per_expert.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (per_expert + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # assignments, expert by expert
    expert_of = flat[order]
    rank = torch.arange(count, device=device) - (torch.cumsum(per_expert, 0) - per_expert)[expert_of]
    num_blocks = -(-(count + num_experts * (block_m - 1)) // block_m)
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=device)
    rows[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertBlocks(rows=rows, block_expert=block_expert, block_m=block_m)


def _one_token_blocks(ids: torch.Tensor, block_m: int) -> ExpertBlocks:
    """The layout of one token's k assignments (distinct experts, as top-k picks them): block b
    holds assignment b alone, of expert ids[0, b] (int64, read in place: no launch at all)."""
    return ExpertBlocks(
        rows=_one_token_rows(ids.shape[1], block_m, ids.device), block_expert=ids[0], block_m=block_m
    )


# One token's rows depend on (k, block_m, device) alone: built once and kept, so a batch-1 decode
# step's layout costs no launch (it cost three a layer: arange, and pad's fill and copy).
_ONE_TOKEN_ROWS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _one_token_rows(top_k: int, block_m: int, device: torch.device) -> torch.Tensor:
    key = (top_k, block_m, device)
    rows = _ONE_TOKEN_ROWS.get(key)
    if rows is None:
        first = torch.arange(top_k, dtype=torch.int32, device=device)[:, None]
        rows = torch.nn.functional.pad(first, (0, block_m - 1), value=-1).flatten()
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return rows  # not kept: memory of the graph's pool (the eager run before a capture keeps one)
        _ONE_TOKEN_ROWS[key] = rows
    return rows
