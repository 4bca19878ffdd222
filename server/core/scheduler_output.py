"""The one contract between the scheduler and the model runner.

New requests travel in full, requests the runner already knows travel as diffs (new block ids and
their computed-token count). The runner keeps its own copy of each request's tokens and appends
the tokens it samples; the scheduler appends the same tokens to its `Request` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tgserve.server.core.host_tier import KVTransfers

if TYPE_CHECKING:
    from tgserve.server.protocol.params import GuidedDecoding, SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state is rebuilt)."""

    request_id: str
    token_ids: list[int]  # prompt plus output so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # already in the KV cache (prefix-cache hits)
    sampling_params: SamplingParams


@dataclass(frozen=True)
class CachedRequestData:
    """A running request: blocks added since the last step and where its computation stands;
    moved_blocks: (index in its block list, new id) of blocks spilled to the host tier this step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    moved_blocks: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute this step.

    num_scheduled_tokens[request_id] tokens are computed for each scheduled request, starting at its
    num_computed_tokens. A request is sampled after the step when that reaches all its tokens.
    finished_request_ids: requests (finished, aborted or preempted) whose runner state can be dropped.
    sampling_request_ids: the requests that reach their last token this step and get a new one.
    kv_transfers: block copies between the pool and the host tier, run before the step's forward.
    grammars_to_prepare: guided requests that arrived since the last step, not scheduled yet, whose
    grammars every runner starts compiling (the engine schedules them once that is done).
    """

    scheduled_new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    sampling_request_ids: frozenset[str] = frozenset()
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)
    grammars_to_prepare: tuple[tuple[str, GuidedDecoding], ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
