"""Frozen engine configuration, built once by the CLI or the offline API."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step and of the KV pool.

    max_num_batched_tokens: the per-step token budget; a prompt longer than what is left of it is
    prefilled in chunks. max_num_seqs: requests running at once. num_blocks x block_size tokens of KV.
    whole_prompt_tokens: a prompt with at least this many tokens left to compute after its prefix-cache
    hit is prefilled whole, in a step of its own, whatever the budget (None: never). Sparse prefill
    needs the whole prompt in one step: chunks would each attend densely over the paged context.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    whole_prompt_tokens: int | None = None
    num_host_blocks: int = 0  # the host tier of the prefix cache (core/host_tier.py); 0: off
    # The long-context tier: (first, last) blocks of a request kept on the device while its cold
    # ones move to the host tier (`BlockManager.spill`); None: off (the backend reads no host blocks).
    spill_keep: tuple[int, int] | None = None
    # Contexts longer than this may spill to make room for other requests (selective decode reads
    # only a budget of their blocks, wherever they lie); None: a request spills only its own
    # blocks, when it would otherwise preempt itself.
    spill_min_context: int | None = None
    # The block id of host block 0 in block tables: None, num_blocks; past it where the pool keeps
    # device blocks of its own after the block manager's (the hot-block cache's).
    first_host_block_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be a non-negative integer, got {self.num_host_blocks!r}")
        whole = self.whole_prompt_tokens
        if whole is not None and (not isinstance(whole, int) or whole <= 0):
            raise ValueError(f"whole_prompt_tokens must be a positive integer or None, got {whole!r}")
