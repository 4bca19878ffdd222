"""Static shapes for graph-compiled devices (Gaudi's HPU graphs, CUDA graphs): the buckets that batch
sizes, prefill lengths and context lengths (in blocks) are padded up to, so that serving meets only
shapes that warmup compiled.

Two schemes, as vLLM's Gaudi plugin names them:
- linear (min, step, max): powers of two from min up to step (a ramp, so small batches do not pad
  to a whole step), then every multiple of step up to max;
- exponential (min, max): powers of two from min, and max itself.
tgi-gaudi's knobs map onto linear steps: BATCH_BUCKET_SIZE (decode batch), PREFILL_BATCH_BUCKET_SIZE
(prefill batch) and PAD_SEQUENCE_TO_MULTIPLE_OF (prefill tokens).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


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


@dataclass(frozen=True)
class StaticShapes:
    """Every dimension's buckets. A decode step is (batch, blocks per sequence); a prefill step is
    (batch, tokens per sequence), its total bounded by the step's token budget."""

    decode_batch: list[int]
    decode_blocks: list[int]
    prefill_batch: list[int]
    prefill_tokens: list[int]
    max_batched_tokens: int

    @classmethod
    def from_limits(
        cls,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        scheme: str = "linear",
        batch_step: int = 8,  # BATCH_BUCKET_SIZE
        prefill_batch_step: int = 4,  # PREFILL_BATCH_BUCKET_SIZE
        token_step: int = 128,  # PAD_SEQUENCE_TO_MULTIPLE_OF
    ) -> StaticShapes:
        max_blocks = -(-max_model_len // block_size)
        max_prompt = min(max_model_len, max_num_batched_tokens)
        max_prefill_batch = min(max_num_seqs, max_num_batched_tokens)
        if scheme == "linear":
            return cls(
                linear_buckets(1, batch_step, max_num_seqs),
                linear_buckets(1, max(1, token_step // block_size), max_blocks),
                linear_buckets(1, prefill_batch_step, max_prefill_batch),
                linear_buckets(min(token_step, max_prompt), token_step, max_prompt),
                max_num_batched_tokens,
            )
        if scheme == "exponential":
            return cls(
                exponential_buckets(1, max_num_seqs),
                exponential_buckets(1, max_blocks),
                exponential_buckets(1, max_prefill_batch),
                exponential_buckets(min(token_step, max_prompt), max_prompt),
                max_num_batched_tokens,
            )
        raise ValueError(f"bucketing scheme must be 'linear' or 'exponential', got {scheme!r}")

    def decode_shape(self, num_seqs: int, max_blocks: int) -> tuple[int, int]:
        return (
            bucket_for(self.decode_batch, num_seqs, "decode batch"),
            bucket_for(self.decode_blocks, max_blocks, "context blocks"),
        )

    def prefill_shape(self, num_seqs: int, max_tokens: int) -> tuple[int, int]:
        return (
            bucket_for(self.prefill_batch, num_seqs, "prefill batch"),
            bucket_for(self.prefill_tokens, max_tokens, "prefill tokens"),
        )

    def warmup_shapes(self) -> list[tuple[str, int, int]]:
        """Every (phase, batch, length) to compile: prefill shapes whose padded size fits the token
        budget (the scheduler must then count a prefill step's padded size against the budget, as
        vLLM's Gaudi scheduler does: unpadded, three prompts of 700 tokens fit 2048 but pad to
        3 x 768), and every decode shape. Largest first, so memory pools are sized by the first."""
        prefill = [
            ("prefill", batch, tokens)
            for batch in self.prefill_batch
            for tokens in self.prefill_tokens
            if batch * tokens <= self.max_batched_tokens or batch == 1
        ]
        decode = [("decode", batch, blocks) for batch in self.decode_batch for blocks in self.decode_blocks]
        by_size = sorted(prefill, key=lambda s: s[1] * s[2], reverse=True)
        return by_size + sorted(decode, key=lambda s: s[1] * s[2], reverse=True)
