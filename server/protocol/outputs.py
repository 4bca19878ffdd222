"""What the engine reports after each step, per request that produced tokens or finished."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and, when asked, the top alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class RequestOutput:
    """A delta: the tokens a request gained in one step (usually one), and whether it has finished.

    finish_reason is None while running, else "length", "eos_token", "stop_sequence", "abort" or
    "grammar_error" (a guided request whose grammar failed in the engine).
    prompt_logprobs, when the request asked for them, comes once, with its first token: one entry
    per prompt token, None for the first. scheduled_at is when the engine first scheduled the
    request, on `time.monotonic()`'s clock, which every process of the host shares: the router
    subtracts its own submission time from it to get the time the request queued.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None = None
    scheduled_at: float | None = None


# Upper bounds (s) of the step-duration histograms: a decode step of a small model on a GPU takes
# milliseconds, a whole 128K-token prompt seconds.
STEP_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass(frozen=True)
class StepDurations:
    """Every engine step of one kind since start: counts per STEP_BUCKETS bound (not cumulative; the
    last entry counts steps over the largest bound), and the sum of their durations."""

    method: str  # "prefill": it started a request or computed a prompt chunk; else "decode"
    bucket_counts: list[int]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: queue sizes, KV usage and counters since start."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens found there
    # The host tier of the prefix cache (--kv-offload-gb; zeros when off): its blocks, the prompt
    # tokens loaded from it, and blocks written to it, loaded from it and dropped from it, with
    # the bytes those moved.
    host_num_total_blocks: int = 0
    host_num_used_blocks: int = 0
    host_prefix_hits: int = 0
    host_offloaded_blocks: int = 0
    host_loaded_blocks: int = 0
    host_evicted_blocks: int = 0
    host_swapped_out_requests: int = 0  # preemptions that swapped the KV out instead of dropping it
    host_spilled_blocks: int = 0  # running requests' cold blocks moved to host (the long-context tier)
    # Host blocks selective decode chose, per layer and KV head: read from the hot-block cache on
    # the device, and not (over the link), as of a recent step.
    host_hot_block_hits: int = 0
    host_hot_block_misses: int = 0
    host_block_bytes: int = 0
    # Steps that gave a request no token because its guided mask was late (or the token before was).
    num_deferred_steps: int = 0
    step_num_tokens: int = 0  # tokens computed in the last step
    step_num_seqs: int = 0  # requests in the last step
    step_durations: list[StepDurations] = field(default_factory=list)  # by kind (step_timing.StepClock)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)
