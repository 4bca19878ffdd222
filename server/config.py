"""Frozen engine configuration, built once by the CLI or the offline API."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step and of the KV pool.

    max_num_batched_tokens: the per-step token budget; a prompt longer than what is left of it is
    prefilled in chunks. max_num_seqs: requests running at once. num_blocks x block_size tokens of KV.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
