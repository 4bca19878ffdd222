"""Selective decode attention: a key summary per KV block, and the blocks a decode query attends.

Over a long context most of a decode query's attention falls on few keys, but dense decode reads
all of them every step (64 GiB a step at a million tokens of Llama-3-8B in fp8). Quest (Tang et al.,
ICML 2024) keeps, per block and KV head, the channel-wise minimum and maximum of its keys; for a
query q, sum_d max(q_d * min_d, q_d * max_d) bounds q . k from above for every key of the block.
Each step ranks the blocks of a sequence by that bound, per KV head (the largest over the heads that
share it: their reads are shared), always keeps the first blocks (the attention sink) and the most
recent ones, and attends exactly over the top blocks within a token budget. A summary is 2 x
head_dim values a block and head: 1/8 of an fp8 cache's bytes at 16-token blocks, 1/16 of bf16's.

The bound is loose where a block's keys spread over many channels (rotary's fast channels above
all), so it ranks some blocks of small logits above the one a query seeks. The blocks it ranks best,
`candidates` times as many as are chosen, are therefore scored again by their largest true logit,
read from the cache (a few MB a layer), and the best of those are chosen. On SmolLM2 with a
needle at the middle of a 7K-token text and a budget of 1,024 tokens, the bound alone loses the
needle and two candidates per choice find it, as choosing by the true logits of every block does;
over 50 placements two candidates still lost 4 needles that dense attention found, and four lost
none (28 found against dense's 25; docs/benchmarks/2026-12-03-needle-selective-decode-cpu.md).

Layouts:
    key_summary  [2, num_blocks, num_kv_heads, head_dim], the model's dtype; [0] minimum, [1] maximum
    selection    (chosen int64 [num_seqs, num_kv_heads, k - 1], lengths int32 [num_seqs]): per KV
                 head the chosen blocks' columns of the block table, in no particular order (decode
                 attention sums over keys in any order; sorting cost 30 us a layer on an H200),
                 then, implicitly, the current block, always read last; and the tokens the k blocks
                 hold (0: the sequence attends densely through its whole block table, as it does
                 when no block would be dropped, so a budget at least the context is the dense
                 path, bit for bit)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeSelection:
    """--decode-attention-budget and its threshold: decoding sequences whose context is longer than
    `min_context` tokens attend over `budget` of them (the sink and the recent window included)."""

    budget: int
    min_context: int
    sink: int = 64  # the first tokens, always attended (StreamingLLM's attention sink)
    recent: int = 512  # the last tokens, always attended
    candidates: int = 4  # blocks ranked by the bound, then scored exactly, for each one chosen

    @classmethod
    def for_budget(cls, budget: int, min_context: int) -> DecodeSelection:
        """The flags' selection: of the budget, 1/64 for the sink and 1/8 for the recent window
        (64 and 512 tokens of 4,096); the rest is chosen."""
        return cls(budget, min_context, sink=max(1, budget // 64), recent=max(1, budget // 8))

    def check(self, block_size: int) -> None:
        """A clear error for a budget that leaves no block to choose."""
        least = self.sink_blocks(block_size) * block_size + self.recent_blocks(block_size) * block_size
        if self.budget < least + block_size:
            raise ValueError(
                f"--decode-attention-budget {self.budget} must be at least {least + block_size} tokens: the "
                f"attention sink ({self.sink}) and the recent window ({self.recent}), in whole blocks of "
                f"{block_size}, and one block to choose"
            )
        if self.min_context < 0:
            raise ValueError(f"--decode-attention-min-context must be at least 0, not {self.min_context}")

    def budget_blocks(self, block_size: int) -> int:
        return self.budget // block_size

    def chosen_blocks(self, block_size: int, table_width: int) -> int:
        """How many blocks a step chooses per KV head: the budget's, or every column of a table
        narrower than that."""
        return min(self.budget_blocks(block_size), table_width)

    def candidate_blocks(self, block_size: int, table_width: int) -> int:
        """How many blocks the bound hands on to be scored exactly, per KV head."""
        return min(table_width, self.candidates * (self.chosen_blocks(block_size, table_width) - 1))

    def lengths(self, seq_lens: torch.Tensor, block_size: int, table_width: int) -> torch.Tensor:
        """The step's `selected_lengths` (once a step: every layer's choice holds as many tokens)."""
        k = self.chosen_blocks(block_size, table_width)
        return selected_lengths(seq_lens, k, block_size, seq_lens > self.min_context)

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sink // block_size)

    def recent_blocks(self, block_size: int) -> int:
        """The recent window in blocks, the current (partly filled) block among them."""
        return max(1, -(-self.recent // block_size))

    def selects(self, max_context: int) -> bool:
        """Whether a step whose contexts reach `max_context` selects at all: some context passes the
        threshold. (A context within the budget then drops nothing and takes the dense path.)"""
        return max_context > self.min_context


def top_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [..., k]: the k best-scored blocks of each row, in no order. torch.topk: a radix-select
    Triton kernel of one program a row was 1.5x slower at 128K and 13x at 1M tokens on an H200
    (8 rows a step leave most SMs idle; docs/benchmarks/2026-12-05-families-and-selection-h200.md)."""
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def choose_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [num_seqs, num_kv_heads, k - 1]: the k - 1 best-scored blocks of each (sequence, KV
    head), in no order; the current block (scored -inf) is the k-th, read after them. Only a
    context of more than k blocks reads them (`selected_lengths`), so every pick is in its context."""
    return top_blocks(scores, k - 1)


def selected_lengths(seq_lens: torch.Tensor, k: int, block_size: int, selected: torch.Tensor) -> torch.Tensor:
    """int32 [num_seqs]: the tokens k blocks hold, the current one among them (every dropped block
    is a full one), where a `selected` sequence has more than k blocks; else 0: it attends densely."""
    dropped = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor") - k
    return torch.where(selected & (dropped > 0), seq_lens - dropped * block_size, 0).to(torch.int32)


def chosen_mask(chosen: torch.Tensor, seq_lens: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """bool [num_seqs, num_kv_heads, width]: True at the chosen block positions and the current block."""
    mask = torch.zeros(*chosen.shape[:2], width, dtype=torch.bool, device=chosen.device)
    current = torch.div(seq_lens.long() - 1, block_size, rounding_mode="floor")
    mask[torch.arange(len(seq_lens), device=chosen.device), :, current] = True
    return mask.scatter_(2, chosen, True)
