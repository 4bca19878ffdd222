"""Running one validated generation against the engine: admission, detokenization, stop strings,
metrics, and clean-up (abort) however the request ends.

`SequenceState.apply` is pure (engine deltas in, text deltas out) and unit-tested without an engine;
`Generation` drives one or more sequences of one prompt through the `EngineClient`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tgserve.router.detokenizer import IncrementalDetokenizer, StopChecker
from tgserve.router.engine_client import EngineClient
from tgserve.router.errors import OverloadedError, RouterError
from tgserve.router.metrics import RouterMetrics
from tgserve.router.tokenization import RouterTokenizer
from tgserve.router.validation import GenerationSpec
from tgserve.server.protocol.outputs import RequestOutput, TokenLogprob
from tgserve.server.protocol.params import SamplingParams

logger = logging.getLogger("tgserve.router")


@dataclass(frozen=True)
class TokenInfo:
    """One generated token: its text (what it added to the output), log-probability and alternatives."""

    id: int
    text: str
    logprob: float | None
    special: bool
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SequenceDelta:
    """What one sequence gained from one engine step: tokens, the text to show now, and whether it ended."""

    index: int
    tokens: list[TokenInfo]
    text: str
    finish_reason: str | None
    num_generated_tokens: int


class SequenceState:
    """Everything the router tracks for one engine request."""

    def __init__(self, prompt_index: int, index: int, tokenizer: RouterTokenizer, spec: GenerationSpec):
        self.prompt_index = prompt_index
        self.index = index
        self.tokenizer = tokenizer
        self.params: SamplingParams = spec.params[index]
        self.detokenizer = IncrementalDetokenizer(tokenizer.decode, spec.prompt_token_ids)
        self.stop_checker = StopChecker(spec.stop, include_stop=spec.include_stop)
        self.tokens: list[TokenInfo] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked, with the first token
        self.text = ""
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, output: RequestOutput) -> SequenceDelta:
        """Turn one engine delta into tokens and shown text; a stop string ends the sequence here."""
        new_tokens: list[TokenInfo] = []
        shown = ""
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        for position, token_id in enumerate(output.new_token_ids):
            token = self._token(token_id, output, position)
            new_tokens.append(token)
            shown += self.stop_checker.feed(token.text if not token.special else "")
            if self.stop_checker.stopped:
                self.finish_reason = "stop_sequence"
                break
        if output.finished and not self.finished:
            shown += self.stop_checker.feed(self.detokenizer.flush())
            shown += self.stop_checker.flush()
            self.finish_reason = (
                "stop_sequence" if self.stop_checker.stopped else output.finish_reason or "length"
            )
        self.tokens.extend(new_tokens)
        self.text += shown
        return SequenceDelta(self.index, new_tokens, shown, self.finish_reason, len(self.tokens))

    def _token(self, token_id: int, output: RequestOutput, position: int) -> TokenInfo:
        special = self.tokenizer.is_special(token_id)
        text = self.detokenizer.add(token_id)
        if special:
            text = self.tokenizer.token_text(token_id)  # shown in details, never in the output text
        logprob = output.new_logprobs[position] if output.new_logprobs else None
        return TokenInfo(
            id=token_id,
            text=text,
            logprob=None if logprob is None else finite_or_none(logprob.logprob),
            special=special,
            top=finite_top(logprob.top) if logprob is not None else [],
        )


def finite_or_none(value: float) -> float | None:
    """JSON has no infinities: a -inf log-probability is reported as null."""
    return value if math.isfinite(value) else None


def finite_top(top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Alternatives JSON can carry: those with a finite log-probability."""
    return [(i, lp) for i, lp in top if math.isfinite(lp)]


class Admission:
    """--max-concurrent-requests: over it, a request is refused at once (429), never queued."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0

    def acquire(self) -> None:
        if self.in_use >= self.limit:
            raise OverloadedError(
                f"the server is serving --max-concurrent-requests={self.limit} requests; retry later"
            )
        self.in_use += 1

    def release(self) -> None:
        self.in_use -= 1


@dataclass(frozen=True)
class Timings:
    """A finished generation's durations in seconds: what the request metrics record and what TGI's
    `x-*-time` response headers report.

    As TGI's: the queue ends when the engine first schedules the request, and inference (the prompt's
    prefill, then decoding) runs from there to the last token.
    """

    validation: float
    queue: float  # submitted to the engine -> first scheduled
    inference: float  # first scheduled -> the last token
    total: float  # validation, then admission to the end
    per_token: float  # inference over the generated tokens (0 when there are none)


class Generation:
    """One HTTP request's engine work: one or more prompts, each with one or more sequences.

    Created by `Generator.start` (which admits and submits it); `deltas()` yields every sequence's
    deltas as they come; `close()` must always run: it aborts what is unfinished, releases the
    admission slot and records the outcome.
    """

    def __init__(self, generator: Generator, specs: list[GenerationSpec], validation_s: float):
        self.generator = generator
        self.specs = specs
        self.started_at = time.monotonic()
        self.validation_s = validation_s
        self.states: dict[str, SequenceState] = {}
        self.first_token_at: dict[str, float] = {}
        self.scheduled_at: dict[str, float] = {}  # when the engine first gave each sequence a step
        self.last_token_at: dict[str, float] = {}
        self.closed = False
        self.error: RouterError | None = None
        self.num_prompt_tokens = sum(spec.num_prompt_tokens for spec in specs)
        self.sequences: list[SequenceState] = []
        self.submitted_at = self.started_at
        self.timings: Timings | None = None  # set when it finishes successfully

    def prompt_logprobs(self, prompt_index: int) -> list[TokenLogprob | None] | None:
        """The prompt's scored tokens, from whichever of its sequences was asked to score it."""
        for seq in self.sequences:
            if seq.prompt_index == prompt_index and seq.prompt_logprobs is not None:
                return seq.prompt_logprobs
        return None

    def submit(self) -> None:
        base = uuid.uuid4().hex
        requests: list[tuple[str, list[int], SamplingParams]] = []
        for spec_index, spec in enumerate(self.specs):
            for seq_index, params in enumerate(spec.params):
                request_id = f"{base}-{spec_index}-{seq_index}"
                state = SequenceState(spec_index, seq_index, self.generator.tokenizer, spec)
                self.states[request_id] = state
                self.sequences.append(state)
                requests.append((request_id, spec.prompt_token_ids, params))
        self.submitted_at = time.monotonic()
        self.queue = self.generator.client.submit(requests)

    async def deltas(self) -> AsyncIterator[tuple[int, SequenceDelta]]:
        """(prompt index, delta) for every sequence until all have finished."""
        unfinished = set(self.states)
        while unfinished:
            item = await self.queue.get()
            if isinstance(item, RouterError):
                self.error = item
                raise item
            state = self.states.get(item.request_id)
            if state is None or item.request_id not in unfinished:
                continue
            delta = state.apply(item)
            self._record_timing(item.request_id, len(delta.tokens), item.scheduled_at)
            if state.finished:
                unfinished.discard(item.request_id)
                self.generator.client.release([item.request_id])
                if delta.finish_reason == "stop_sequence" and not item.finished:
                    self.generator.client.finish(item.request_id, "stop_sequence")
            yield state.prompt_index, delta

    def _record_timing(self, request_id: str, num_tokens: int, scheduled_at: float | None) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        metrics = self.generator.metrics
        previous = self.last_token_at.get(request_id)
        if previous is None:
            self.first_token_at[request_id] = now
            # Within [submission, first token] whatever the engine reported (None: no schedule time).
            scheduled = now if scheduled_at is None else min(max(scheduled_at, self.submitted_at), now)
            self.scheduled_at[request_id] = scheduled
            metrics.time_to_first_token.observe(now - self.submitted_at)
            metrics.queue_duration.observe(scheduled - self.submitted_at)
            metrics.prefill.observe(now - scheduled)
            num_tokens -= 1
            previous = now
        for _ in range(num_tokens):
            metrics.inter_token_latency.observe((now - previous) / max(1, num_tokens))
        self.last_token_at[request_id] = now

    def close(self) -> None:
        """Abort unfinished sequences, free the admission slot, record success or failure. Idempotent."""
        if self.closed:
            return
        self.closed = True
        unfinished = [rid for rid, state in self.states.items() if not state.finished]
        self.generator.client.abort(unfinished)
        self.generator.admission.release()
        self._record_outcome(unfinished)

    def _record_outcome(self, unfinished: list[str]) -> None:
        metrics = self.generator.metrics
        metrics.in_flight.dec()
        if self.error is not None:
            metrics.request_failure.labels(err=self.error.kind).inc()
            return
        if unfinished:
            metrics.request_failure.labels(err="aborted").inc()
            return
        generated = sum(len(state.tokens) for state in self.states.values())
        self.timings = self._timings(time.monotonic(), generated)
        metrics.request_success.inc()
        metrics.request_duration.observe(self.timings.total)
        metrics.generated_tokens.observe(generated)
        metrics.inference_duration.observe(self.timings.inference)
        if generated:
            metrics.mean_time_per_token.observe(self.timings.per_token)
        self._log_success(self.timings, generated)

    def _log_success(self, timings: Timings, generated: int) -> None:
        """One line a request, as TGI logs it: sizes, durations and how it ended (never the text)."""
        finishes = sorted({state.finish_reason or "" for state in self.states.values()})
        logger.info(
            "success: prompt_tokens=%d generated_tokens=%d total_time=%.3fs validation_time=%.1fms "
            "queue_time=%.1fms inference_time=%.3fs time_per_token=%.1fms finish=%s",
            self.num_prompt_tokens,
            generated,
            timings.total,
            timings.validation * 1e3,
            timings.queue * 1e3,
            timings.inference,
            timings.per_token * 1e3,
            ",".join(finishes),
        )

    def _timings(self, now: float, generated: int) -> Timings:
        started = min(self.scheduled_at.values(), default=now)
        return Timings(
            validation=self.validation_s,
            queue=started - self.submitted_at,
            inference=now - started,
            total=now - self.started_at + self.validation_s,
            per_token=(now - started) / generated if generated else 0.0,
        )


class Generator:
    """Shared by the routes: the engine client, the tokenizer, admission and metrics."""

    def __init__(
        self, client: EngineClient, tokenizer: RouterTokenizer, metrics: RouterMetrics, admission: Admission
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.admission = admission

    def start(self, specs: list[GenerationSpec], validation_s: float) -> Generation:
        """Admit and submit; raises OverloadedError (429) or EngineUnavailableError (503) at once."""
        self.admission.acquire()
        self.metrics.in_flight.inc()
        generation = Generation(self, specs, validation_s)
        try:
            generation.submit()
        except RouterError:
            # Nothing reached the engine; the caller records the failure.
            generation.closed = True
            self.admission.release()
            self.metrics.in_flight.dec()
            raise
        for spec in specs:
            self.metrics.input_length.observe(spec.num_prompt_tokens)
            self.metrics.max_new_tokens.observe(spec.params[0].max_new_tokens)
        self.metrics.validation_duration.observe(validation_s)
        return generation

    async def run(self, generation: Generation) -> Generation:
        """Consume a generation to its end (non-streaming routes); the states hold the results."""
        try:
            async for _ in generation.deltas():
                pass
        finally:
            generation.close()
        return generation
