"""Static shapes for graph-compiled devices (Gaudi's HPU graphs, CUDA graphs): the buckets that batch
sizes, prefill lengths and context lengths (in blocks) are padded up to, so that serving meets only
shapes that warmup compiled.

Two schemes, as vLLM's Gaudi plugin names them:
- linear (min, step, max): powers of two from min up to step (a ramp, so small batches do not pad
  to a whole step), then every multiple of step up to max;
- exponential (min, max): powers of two from min, and max itself.
tgi-gaudi's knobs map onto linear steps: BATCH_BUCKET_SIZE (decode batch), PREFILL_BATCH_BUCKET_SIZE
(prefill batch) and PAD_SEQUENCE_TO_MULTIPLE_OF (prefill tokens).

The engine's steps are flat variable-length batches (chunked prefill and decode rows mix), so a
step is padded as a whole: a decode step to a batch bucket and a block-table bucket, any other
step to a token bucket and a sequence bucket. Padding never needs the scheduler: the largest token
bucket is the step's token budget.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tgserve.server.config.buckets import BucketConfig


def linear_buckets(minimum: int, step: int, maximum: int) -> list[int]:
    if not 0 < minimum <= maximum or step <= 0:
        raise ValueError(
            f"bucket range needs 0 < min <= max and step > 0, got ({minimum}, {step}, {maximum})"
        )
    ramp, size = [], minimum
    while size < min(step, maximum):
        ramp.append(size)
        size *= 2
    steps = list(range(step, maximum + 1, step)) if step >= minimum else []
    return sorted({*ramp, *steps, maximum})


def exponential_buckets(minimum: int, maximum: int) -> list[int]:
    if not 0 < minimum <= maximum:
        raise ValueError(f"bucket range needs 0 < min <= max, got ({minimum}, {maximum})")
    sizes, size = [], minimum
    while size < maximum:
        sizes.append(size)
        size *= 2
    return [*sizes, maximum]


def bucket_for(buckets: list[int], value: int, what: str) -> int:
    """The smallest bucket that holds `value`."""
    index = bisect.bisect_left(buckets, value)
    if index == len(buckets):
        raise ValueError(f"{what} of {value} exceeds the largest bucket, {buckets[-1]}")
    return buckets[index]


def token_buckets(config: BucketConfig, maximum: int) -> list[int]:
    """Token counts padded to: multiples of `token_step` (linear) or powers of two from it
    (exponential), up to `maximum`."""
    smallest = min(config.token_step, maximum)
    if config.scheme == "linear":
        return linear_buckets(smallest, config.token_step, maximum)
    return exponential_buckets(smallest, maximum)


@dataclass(frozen=True)
class StepShape:
    """The padded shape of one step: what a graph is compiled (or captured) for.

    A decode step (one token per sequence) is padded to `num_seqs` sequences of one token and a
    block table of `num_blocks` columns; any other step to `num_tokens` tokens (always more than
    `num_seqs`) and `num_seqs` sequences, its block table to one column when no sequence has context
    before the step, else to the longest context the model allows. `num_logits` rows reach the LM
    head.
    """

    decode: bool
    num_tokens: int
    num_seqs: int
    num_blocks: int
    num_logits: int


class StaticShapes:
    """The buckets of every dimension, from the engine's limits, and the shape of any step."""

    def __init__(
        self,
        config: BucketConfig,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.config = config
        self.max_blocks = -(-max_model_len // block_size)
        block_step = max(1, config.token_step // block_size)
        # A prefill shape has more tokens than sequences, so that no prefill shape is also a decode
        # shape (a backend may choose its path from the shape alone).
        if max_num_seqs >= max_num_batched_tokens:
            raise ValueError(
                f"static shapes need fewer sequences per step ({max_num_seqs}) than tokens per step "
                f"({max_num_batched_tokens})"
            )
        if config.scheme == "linear":
            self.decode_batch = linear_buckets(1, config.batch_step, max_num_seqs)
            self.decode_blocks = linear_buckets(1, block_step, self.max_blocks)
            self.prefill_seqs = linear_buckets(1, config.prefill_batch_step, max_num_seqs)
        else:
            self.decode_batch = exponential_buckets(1, max_num_seqs)
            self.decode_blocks = exponential_buckets(1, self.max_blocks)
            self.prefill_seqs = exponential_buckets(1, max_num_seqs)
        self.prefill_tokens = token_buckets(config, max_num_batched_tokens)
        # Fresh prompts (no cached context) need one block-table column; anything else the longest.
        self.prefill_blocks = sorted({1, self.max_blocks})

    def shape_for(
        self, num_tokens: int, num_seqs: int, num_blocks: int, num_logits: int, fresh: bool = False
    ) -> StepShape:
        """The smallest shape that holds a step; raises ValueError naming the limit it exceeds.

        fresh: no sequence has context before this step (its block table is not read).
        """
        if num_tokens == num_seqs == num_logits:
            batch = bucket_for(self.decode_batch, num_seqs, "decode batch")
            blocks = bucket_for(self.decode_blocks, num_blocks, "context blocks")
            return StepShape(True, batch, batch, blocks, batch)
        seqs = bucket_for(self.prefill_seqs, num_seqs, "prefill sequences")
        tokens = bucket_for(self.prefill_tokens, max(num_tokens, seqs + 1), "prefill tokens")
        # Prompt log-probabilities score every prompt token: then every padded token reaches the head.
        logits = seqs if num_logits <= seqs else tokens
        return StepShape(False, tokens, seqs, 1 if fresh else self.max_blocks, logits)

    def warmup_shapes(self) -> list[StepShape]:
        """Every shape serving can meet (prompt log-probability steps aside), largest first so that
        the first compiled sizes the memory pools."""
        prefill = [
            StepShape(False, tokens, seqs, blocks, seqs)
            for tokens in self.prefill_tokens
            for seqs in self.prefill_seqs
            for blocks in self.prefill_blocks
            if seqs < tokens
        ]
        decode = [
            StepShape(True, batch, batch, blocks, batch)
            for batch in self.decode_batch
            for blocks in self.decode_blocks
        ]
        return sorted(prefill, key=lambda s: (s.num_tokens, s.num_seqs, s.num_blocks), reverse=True) + sorted(
            decode, key=lambda s: (s.num_seqs, s.num_blocks), reverse=True
        )
