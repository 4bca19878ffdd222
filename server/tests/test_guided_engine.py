"""Guided decoding through the engine on the tiny random Llama: under chunked prefill, preemption,
prefix caching and async scheduling, guided outputs follow their grammar, and unguided requests
get the tokens they get without guided neighbours.

Random weights ramble, so the grammars here are bounded (the output has a longest form); what real
text looks like under a JSON schema is test_guided_smollm2.py's question.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.core.request import Request
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import GuidedDecoding, InvalidRequestError, SamplingParams
from tgserve.server.testing.fixtures import fixture_path

PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((40, 9, 23, 17, 12, 30, 8, 14, 6, 50))]
PROMPTS[8] = PROMPTS[0][:32] + [99, 98]  # hits the first prompt's cached blocks
ARRIVALS = [0, 0, 0, 1, 1, 2, 2, 3, 12, 4]
# Compact JSON (llguidance's option), so that a rambling model still closes the object in time.
SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["k", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
REGEXES = {
    "r1": r"[a-z]{2,6}",
    "r4": r"(yes|no|maybe)",
    "r6": r"\d{1,3}(\.\d{1,2})?",
    "r8": r"[A-Z][a-z]{0,4}",
}
SAMPLED = dict(temperature=0.9, top_k=50, ignore_eos=True)


def guided_params() -> dict[str, SamplingParams]:
    params = {
        request_id: SamplingParams(
            max_new_tokens=24, seed=i, guided=GuidedDecoding("regex", regex), **SAMPLED
        )
        for i, (request_id, regex) in enumerate(REGEXES.items())
    }
    params["r3"] = SamplingParams(
        temperature=0.0, max_new_tokens=40, guided=GuidedDecoding("json_schema", json.dumps(SCHEMA))
    )
    return params


def unguided_params() -> dict[str, SamplingParams]:
    return {
        "r0": SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        "r2": SamplingParams(max_new_tokens=10, seed=7, **SAMPLED),
        "r5": SamplingParams(temperature=0.0, max_new_tokens=10, repetition_penalty=1.3),
        "r7": SamplingParams(max_new_tokens=14, seed=3, presence_penalty=0.5, **SAMPLED),
        "r9": SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=2),
    }


@dataclass
class Seen:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def make_engine(async_scheduling: bool) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model=str(fixture_path("llama")),
            dtype="float32",
            max_num_batched_tokens=32,
            block_size=8,
            num_blocks=20,
            async_scheduling=async_scheduling,
        )
    )


def serve(engine: LLMEngine, params: dict[str, SamplingParams]) -> dict[str, Seen]:
    """Runs the workload on a schedule that is the same on every host: grammars compiled before the
    step after their arrival, masks waited for (on a slow host a late compile or mask would move a
    guided request to a later step, and the preemptions this workload is built to cause may vanish)."""
    engine.runner.late_mask_grace_s = None
    seen = {request_id: Seen() for request_id in params}
    for step in range(1000):
        engine.runner.guided.wait_for_compiles()
        for i, arrival in enumerate(ARRIVALS):
            if arrival == step and f"r{i}" in params:
                engine.add_request(f"r{i}", PROMPTS[i], params[f"r{i}"])
        if step > max(ARRIVALS) and not engine.needs_step():
            return seen
        for out in engine.step():
            seen[out.request_id].tokens += out.new_token_ids
            seen[out.request_id].finish_reason = out.finish_reason
    raise AssertionError("the workload did not finish")


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict[str, Seen], LLMEngine]]:
    results = {}
    for name, async_scheduling, params in (
        ("alone", False, unguided_params()),
        ("mixed", False, {**unguided_params(), **guided_params()}),
        ("mixed_async", True, {**unguided_params(), **guided_params()}),
    ):
        engine = make_engine(async_scheduling)
        results[name] = serve(engine, params), engine
    return results


def text(engine: LLMEngine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_guided_outputs_follow_their_grammar(runs) -> None:
    seen, engine = runs["mixed"]
    assert engine.scheduler.num_preemptions > 0, "the workload should preempt"
    for request_id, regex in REGEXES.items():
        got = seen[request_id]
        assert got.finish_reason == "eos_token", (request_id, got)
        assert re.fullmatch(regex, text(engine, got.tokens)), (request_id, text(engine, got.tokens))
    value = json.loads(text(engine, seen["r3"].tokens))
    assert value["k"] in ("red", "blue") and 0 <= value["n"] <= 99 and set(value) == {"k", "n"}


def test_unguided_requests_get_the_tokens_they_get_without_guided_ones(runs) -> None:
    alone, mixed = runs["alone"][0], runs["mixed"][0]
    for request_id in unguided_params():
        assert mixed[request_id].tokens == alone[request_id].tokens, request_id
        assert mixed[request_id].finish_reason == alone[request_id].finish_reason, request_id


def test_async_scheduling_gives_every_request_the_same_tokens(runs) -> None:
    synchronous, overlapped = runs["mixed"][0], runs["mixed_async"][0]
    for request_id, expected in synchronous.items():
        got = overlapped[request_id]
        assert (got.tokens, got.finish_reason) == (expected.tokens, expected.finish_reason), request_id


def test_nothing_is_left_behind(runs) -> None:
    for _, engine in runs.values():
        assert not engine.needs_step() and engine.runner.requests == {} and len(engine.runner.guided) == 0


def test_a_grammar_that_fails_ends_its_request_and_no_other() -> None:
    engine = make_engine(False)
    with pytest.raises(InvalidRequestError, match="regular expression"):
        engine.add_request("refused", [5, 6, 7], SamplingParams(guided=GuidedDecoding("regex", "((")))
    # Past the check (as if it compiled there but not here): the loop must survive it.
    bad = SamplingParams(temperature=0.0, max_new_tokens=8, guided=GuidedDecoding("regex", "(("))
    engine.scheduler.add_request(Request("bad", [5, 6, 7], bad, engine.eos_token_ids))
    good = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    engine.add_request("good", [5, 6, 7], good)
    seen = {"bad": Seen(), "good": Seen()}
    while engine.needs_step():
        for out in engine.step():
            seen[out.request_id].tokens += out.new_token_ids
            seen[out.request_id].finish_reason = out.finish_reason
    assert seen["bad"].finish_reason == "grammar_error"
    assert len(seen["bad"].tokens) == 1 and seen["bad"].tokens[0] in engine.eos_token_ids
    assert seen["good"].finish_reason == "length" and len(seen["good"].tokens) == 8


def test_masks_are_computed_beside_the_forward(monkeypatch) -> None:
    """Every guided step's masks come from the mask workers, never more than a job a row."""
    import threading

    from tgserve.server.sampling.guided import GuidedMatchers

    threads: list[str] = []
    compute = GuidedMatchers._fill

    def recorded(self, requests, bits):
        threads.append(threading.current_thread().name)
        return compute(self, requests, bits)

    monkeypatch.setattr(GuidedMatchers, "_fill", recorded)
    engine = make_engine(False)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, guided=GuidedDecoding("regex", r"[a-z]{4}"))
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9, 10], params)
    steps = 0
    while engine.needs_step():
        steps += bool(engine.step())
    assert threads and all(name.startswith("guided-masks") for name in threads)
    # At most a job a request a step: their first masks apart, usually one for both.
    assert len(threads) <= 2 * steps


SLOW_COMPILE_S = 1.5


def test_a_slow_grammar_delays_its_own_request_not_the_batch(monkeypatch) -> None:
    """A grammar that takes 1.5 s to compile (on top of the grammar library's first use): the
    batch's steps go on meanwhile, none waiting for it, then the guided request runs to its end.
    A step that waited would take the whole 1.5 s; half of it leaves room for a loaded machine."""
    import time

    from tgserve.server.sampling import grammar_backends

    compile_matcher = grammar_backends.LLGuidanceBackend.matcher

    def slow(self, spec):
        time.sleep(SLOW_COMPILE_S)
        return compile_matcher(self, spec)

    monkeypatch.setattr(grammar_backends.LLGuidanceBackend, "matcher", slow)
    engine = make_engine(False)
    engine.add_request(
        "plain", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    )
    engine.step()
    guided = SamplingParams(temperature=0.0, max_new_tokens=8, guided=GuidedDecoding("regex", r"[a-z]{4}"))
    engine.add_request("guided", [8, 9, 10], guided)
    seen, longest_step, plain_while_compiling = {"plain": Seen(), "guided": Seen()}, 0.0, 0
    while engine.needs_step():
        start = time.monotonic()
        outputs = engine.step()
        longest_step = max(longest_step, time.monotonic() - start)
        for out in outputs:
            seen[out.request_id].tokens += out.new_token_ids
            seen[out.request_id].finish_reason = out.finish_reason
            plain_while_compiling += out.request_id == "plain" and not seen["guided"].tokens
        if seen["guided"].finish_reason:
            engine.abort_requests(["plain"])
    assert longest_step < SLOW_COMPILE_S / 2 and plain_while_compiling >= 5
    assert re.fullmatch(r"[a-z]{4}", text(engine, seen["guided"].tokens)), seen["guided"]
    assert seen["guided"].finish_reason == "eos_token"


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind() -> None:
    engine = make_engine(False)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, guided=GuidedDecoding("regex", r"[a-z]{4}"))
    engine.add_request("gone", [5, 6, 7], params)
    engine.step()  # its grammar starts compiling
    engine.abort_requests(["gone"])
    while engine.needs_step():
        assert not engine.step()
    assert not engine.has_unfinished_requests() and len(engine.runner.guided) == 0
    engine.add_request("gone", [5, 6, 7], params)  # the id is free again


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_late_mask_delays_its_own_request_not_the_batch(monkeypatch, async_scheduling) -> None:
    """Two requests whose every mask takes 0.6 s (far past the grace after the logits): steps go
    on without them, the unguided and the other guided request take the steps they take without
    them, and the slow requests get the same tokens as when their masks are quick, only later."""
    import time

    from tgserve.server.sampling import grammar_backends
    from tgserve.server.sampling.guided import StepMasks

    params = {
        "plain": SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True),
        "quick": SamplingParams(
            temperature=0.0, max_new_tokens=8, guided=GuidedDecoding("regex", r"[a-z]{4}")
        ),
        "slow": SamplingParams(
            temperature=0.0, max_new_tokens=8, guided=GuidedDecoding("regex", r"(yes|no)!")
        ),
        # Ends by its length on a token whose mask is late (its blocks are kept until that token).
        "slow_capped": SamplingParams(
            temperature=0.0, max_new_tokens=3, guided=GuidedDecoding("regex", r"(yes|no)![a-z]{20}")
        ),
        "sampled": SamplingParams(max_new_tokens=12, seed=5, **SAMPLED),
    }
    prompts = {"plain": [5, 6, 7], "quick": [8, 9, 10], "slow": [11, 12, 13, 14], "sampled": [15, 16]}
    prompts["slow_capped"] = [17, 18, 19]

    def run() -> tuple[dict[str, Seen], dict[str, int], LLMEngine]:
        engine = make_engine(async_scheduling)
        for request_id, request_params in params.items():
            engine.add_request(request_id, prompts[request_id], request_params)
        seen, finished_at, step = {request_id: Seen() for request_id in params}, {}, 0
        while engine.needs_step():
            outputs = engine.step()
            step += 1
            for out in outputs:
                seen[out.request_id].tokens += out.new_token_ids
                seen[out.request_id].finish_reason = out.finish_reason
                if out.finished:
                    finished_at[out.request_id] = step
        return seen, finished_at, engine

    quick_seen, quick_finished_at, _ = run()
    slow_matchers, compile_matcher = set(), grammar_backends.LLGuidanceBackend.matcher
    fill = grammar_backends.LLGuidanceBackend.fill

    def tagged(self, spec):
        matcher = compile_matcher(self, spec)
        if "yes" in spec.text:
            slow_matchers.add(id(matcher))
        return matcher

    def slow_fill(self, pairs, bits):
        if any(id(matcher) in slow_matchers for matcher, _ in pairs):
            time.sleep(0.6)
        return fill(self, pairs, bits)

    waits, gather = [], StepMasks.gather

    def timed_gather(self, *args):  # how long the step waited for its masks
        start = time.monotonic()
        result = gather(self, *args)
        waits.append(time.monotonic() - start)
        return result

    monkeypatch.setattr(grammar_backends.LLGuidanceBackend, "matcher", tagged)
    monkeypatch.setattr(grammar_backends.LLGuidanceBackend, "fill", slow_fill)
    monkeypatch.setattr(StepMasks, "gather", timed_gather)
    seen, finished_at, engine = run()
    assert slow_matchers, "the slow grammar was not used"
    assert engine.scheduler.stats().num_deferred_steps > 0  # what /metrics shows
    for request_id in params:
        assert (seen[request_id].tokens, seen[request_id].finish_reason) == (
            quick_seen[request_id].tokens,
            quick_seen[request_id].finish_reason,
        ), request_id
    assert re.fullmatch(r"(yes|no)!", text(engine, seen["slow"].tokens))
    assert finished_at["slow"] > quick_finished_at["slow"]  # it waited for its masks
    assert seen["slow_capped"].finish_reason == "length" and len(seen["slow_capped"].tokens) == 3
    for request_id in ("plain", "sampled"):  # the unguided rows never waited
        assert finished_at[request_id] == quick_finished_at[request_id], request_id
    # A first mask is filled alone: the quick grammar never waited for the slow one's masks (that
    # would be 30 steps or more). Slack for a loaded host, where a quick mask may be late once or
    # twice itself (3 steps each with async scheduling).
    assert finished_at["quick"] <= quick_finished_at["quick"] + 8
    # The grace: 5 ms, or half the step so far where steps are slower (a loaded host); never 0.6 s.
    assert max(waits) < 0.3, f"a step waited {max(waits):.3f} s for its masks"
    assert not engine.needs_step() and engine.runner.requests == {} and len(engine.runner.guided) == 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_total_blocks


def test_masks_are_waited_for_at_least_the_grace_or_half_the_step_so_far() -> None:
    import time

    from tgserve.server.sampling.guided import mask_grace_s

    now = time.perf_counter()
    assert mask_grace_s(0.005, None) == 0.005
    assert mask_grace_s(0.005, now) == pytest.approx(0.005)
    assert 0.1 <= mask_grace_s(0.005, now - 0.2) < 0.11
    assert mask_grace_s(0.005, now - 30.0) == 1.0
