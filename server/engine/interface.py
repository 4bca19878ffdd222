"""`Engine`: what the engine process, the offline API and the warm-up drive, whichever engine serves.

Two engines implement it: `LLMEngine` (continuous batching over the paged KV cache, every backend)
and the optimum-habana fallback's `StaticBatchEngine` (static-cache models on a Gaudi). Callers
depend on this protocol, never on either class, so a third engine needs no change to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.core.request import FinishReason
from tgserve.server.protocol.outputs import EngineStats, RequestOutput
from tgserve.server.protocol.params import SamplingParams

if TYPE_CHECKING:
    import torch


class Engine(Protocol):
    """One model served step by step: requests in, per-step deltas out."""

    args: EngineArgs
    model_id: str
    tokenizer: Any  # the model's transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype  # what its KV cache stores (the model's dtype, e4m3 or int8)
    max_model_len: int
    max_pool_tokens: (
        int  # the most tokens one request's KV can take (the pool's, and any host tier's it spills to)
    )
    vocab_size: int
    eos_token_ids: frozenset[int]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate and queue; raises InvalidRequestError naming the problem and the limit."""

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish these requests with "abort"; unknown ids are ignored."""

    def finish_request(self, request_id: str, reason: str | FinishReason) -> None:
        """End a request early (a stop string found downstream); it is reported no further."""

    def step(self) -> list[RequestOutput]:
        """Run one step; every request that gained a token or finished, once each."""

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running."""

    def needs_step(self) -> bool:
        """Work for `step`: unfinished requests, or finished ones whose state a step releases."""

    def stats(self) -> EngineStats:
        """A snapshot for metrics."""

    def reset_counters(self) -> None:
        """Zero what `stats` counts since start (after the engine's own warm-up requests)."""

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel workers). Idempotent."""
