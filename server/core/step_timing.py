"""How long the engine's steps take, by kind, for the router's `tgi_batch_inference_duration`.

An engine times each step from its scheduling to the reading of its tokens. With async scheduling
that span starts while the step before still runs on the device, so it holds some of that step's
tail; in steady state it is close to one step's device time.
"""

from __future__ import annotations

import bisect

from tgserve.server.protocol.outputs import STEP_BUCKETS, StepDurations

METHODS = ("prefill", "decode")


def step_kind(new_requests: int, num_tokens: int, num_seqs: int) -> str:
    """ "prefill" when the step started a request (a new or resumed prompt) or computed more than one
    token of a request (a prompt chunk); else "decode", one generated token per request."""
    return "prefill" if new_requests or num_tokens > num_seqs else "decode"


class StepClock:
    """Per-kind histograms of step durations, cumulative since the clock was made."""

    def __init__(self) -> None:
        self._counts = {method: [0] * (len(STEP_BUCKETS) + 1) for method in METHODS}
        self._sums = dict.fromkeys(METHODS, 0.0)

    def record(self, seconds: float, method: str) -> None:
        self._counts[method][bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self._sums[method] += seconds

    def snapshot(self) -> list[StepDurations]:
        return [StepDurations(method, list(self._counts[method]), self._sums[method]) for method in METHODS]
