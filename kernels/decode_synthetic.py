"""Planted decode inputs for selective decode attention, and its error against dense decode.

The structure is `sparse/synthetic.py`'s (rotary harmonics that give the recent window and
RoPE-periodic diagonals, attention sinks, heavy hitters, diffuse noise), seen by one decode query at
the end of the context, plus a needle salient to that query alone: one key at a chosen depth that
shares a direction with the current query and with no earlier one, so no estimate from other
queries would find it; only the block summaries can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from tgserve.kernels import dispatch, reference
from tgserve.kernels.decode_selection import DecodeSelection, choose_blocks
from tgserve.kernels.sparse.synthetic import Planted, needle_coordinate, planted_prompt

# Families of planted structure, so that no budget or estimate is judged on one input family.
PLANTED = Planted(period_frac=0.13)  # the sinks off the diagonals (a period dividing n puts them on one)
FAMILIES = {
    "planted": PLANTED,
    "diffuse": replace(PLANTED, local=6.0, noise=1.5),  # weaker peaks, more mass spread over all keys
    "many heavy hitters": replace(PLANTED, heavy_hitters=64, heavy=8.0),
    "faint needle": replace(PLANTED, needle=11.0),
    "short period": replace(PLANTED, period_frac=0.013),  # ten times the diagonals
}


@dataclass
class PlantedDecode:
    query: torch.Tensor  # [1, num_heads, head_dim]: the query at position n - 1
    key: torch.Tensor  # [n, num_kv_heads, head_dim]
    value: torch.Tensor
    scale: float
    needle: int  # the key only this query looks for


def planted_decode(
    n: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int, depth: float,
    plant: Planted = Planted(), dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> PlantedDecode:  # fmt: skip
    """A planted context of n keys and its last query, the needle at `depth` (0: first, 1: last)."""
    prompt = planted_prompt(
        n, num_heads, num_kv_heads, head_dim, seed, replace(plant, seekers=0), dtype, device
    )
    coordinate = needle_coordinate(head_dim)
    direction = math.sqrt(plant.needle / prompt.scale)
    needle = min(n - 1, plant.sinks + int(depth * (n - 1 - plant.sinks)))
    key = prompt.key.clone()
    key[:, :, coordinate] = 0.0
    key[needle, :, coordinate] = direction
    query = prompt.query[n - 1 :].clone()
    query[..., coordinate] = direction
    return PlantedDecode(query, key, prompt.value, prompt.scale, needle)


def paged_context(inputs: PlantedDecode, block_size: int, seed: int = 0) -> tuple:
    """(kv_cache, block_tables [1, W], seq_lens [1], key_summary): the context at shuffled blocks."""
    n, num_kv, dim = inputs.key.shape
    num_blocks = -(-n // block_size)
    device = inputs.key.device
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(device)
    cache = torch.zeros(2, num_blocks, block_size, num_kv, dim, dtype=inputs.key.dtype, device=device)
    pos = torch.arange(n, device=device)
    slots = order[pos // block_size] * block_size + pos % block_size
    dispatch.write_kv(inputs.key, inputs.value, cache, slots)
    summary = torch.zeros(2, num_blocks, num_kv, dim, dtype=inputs.key.dtype, device=device)
    dispatch.update_key_summaries(inputs.key, slots, summary, block_size)
    seq_lens = torch.tensor([n], dtype=torch.int32, device=device)
    return cache, order[None].to(torch.int32), seq_lens, summary


def oracle_scores(inputs: PlantedDecode, selection: DecodeSelection, block_size: int) -> torch.Tensor:
    """Block scores as `block_scores` forms them, but from each block's largest true logit instead of
    a bound on it: what a perfect estimate would choose at the same budget."""
    n, num_kv, dim = inputs.key.shape
    q = inputs.query[0].float().view(num_kv, -1, dim)
    logits = torch.einsum("kgd,tkd->kgt", q, inputs.key.float()).amax(1)  # [num_kv, n]
    num_blocks = -(-n // block_size)
    padded = torch.full((num_kv, num_blocks * block_size), float("-inf"), device=logits.device)
    padded[:, :n] = logits
    # Columns of the block table are the positions' blocks in order.
    in_order = padded.view(num_kv, num_blocks, block_size).amax(-1)[None]
    seq_lens = torch.tensor([n], device=logits.device)
    return reference.forced_block_scores(in_order, seq_lens, block_size, selection.sink_blocks(block_size),
                                         selection.recent_blocks(block_size))  # fmt: skip


def selection_error(
    inputs: PlantedDecode, selection: DecodeSelection, block_size: int, oracle: bool = False
) -> float:
    """Relative L2 of selective decode's output (on CUDA the kernels, elsewhere their twins)
    against dense attention in float32; with `oracle`, of the blocks a perfect estimate picks."""
    cache, tables, seq_lens, summary = paged_context(inputs, block_size)
    if oracle:
        k = selection.chosen_blocks(block_size, tables.shape[1])
        chosen = choose_blocks(oracle_scores(inputs, selection, block_size), k)
    else:
        chosen = dispatch.select_decode_blocks(inputs.query, summary, tables, seq_lens, selection, cache)
    lengths = selection.lengths(seq_lens, block_size, tables.shape[1])
    selected = dispatch.paged_decode(
        inputs.query, cache, tables, seq_lens, inputs.scale, selection=(chosen, lengths)
    )
    exact = reference.masked_attention(inputs.query.float(), inputs.key.float(), inputs.value.float(),
                                       torch.ones(1, inputs.key.shape[0], dtype=torch.bool, device=cache.device),
                                       inputs.scale)  # fmt: skip
    return ((selected.float() - exact).norm() / exact.norm()).item()
