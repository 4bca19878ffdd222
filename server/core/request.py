"""The engine's state for one request. Plain Python: the scheduler and block manager use it without torch."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tgserve.server.protocol.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request stopped; the values are TGI's names."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ABORT = "abort"
    # Guided decoding: the grammar failed to compile, or allows no next token.
    GRAMMAR_ERROR = "grammar_error"


class Request:
    """A prompt and its growing output.

    The one scheduling rule: `num_computed_tokens` (tokens whose KV is in the cache) catches up with
    `num_tokens` (prompt plus output). Preemption resets it to 0 and the tokens are recomputed,
    unless the KV was swapped out to the host tier (it comes back on resuming).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens being sampled by steps whose output has not arrived yet (async scheduling).
        self.num_output_placeholders = 0
        # A step gave it no token (its grammar's mask was late): steps already scheduled after that
        # one read a token that never came, so it is not scheduled again until they are all back.
        self.held_for_deferred = False
        # Prompt tokens found in the prefix cache the first time the request was scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        # When the engine first gave it a step (time.monotonic()): the end of its wait in the queue.
        self.first_scheduled_time: float | None = None
        self.finish_reason: FinishReason | None = None

    def mark_running(self) -> None:
        """Scheduled into a step; the first time ends its wait in the queue (preemption does not restart it)."""
        self.status = RequestStatus.RUNNING
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stop_reason(self, token_id: int, max_len: int) -> FinishReason | None:
        """Why the request stops after gaining `token_id` (already appended), or None; `max_len`
        bounds prompt plus output. The token that ended generation says more than the limit it
        happened to reach, so the token checks come first."""
        params = self.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if token_id in params.stop_token_ids:
            return FinishReason.STOP_SEQUENCE
        if self.num_output_tokens >= params.max_new_tokens or self.num_tokens >= max_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
