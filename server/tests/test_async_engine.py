"""The engine with async scheduling gives every request what the synchronous loop gives it.

With async scheduling a step is scheduled and launched before the previous step's tokens are read:
tokens still on their way are read from the device by the next step, and a request that stops on
a token the scheduler learns late has one step computed for nothing, which is dropped. One
workload exercises what that can break: chunked prefill, preemption, prefix-cache hits, seeded
sampling, penalties (which need the tokens in flight on the host), logprobs, prompt logprobs,
stop tokens, a stop found downstream (`finish_request`) and an abort. It runs over a KV cache in
the model's dtype and over 8-bit ones (quantized rows written, recomputed after preemption, shared
by prefix hits and read back by every kind of step), and with selective decode attention on (key
summaries folded by every kind of step, blocks chosen by decode steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.execution.runner import PLACEHOLDER
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.fixtures import fixture_path

PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((40, 9, 23, 17, 12, 30, 8, 14, 6, 50))]
PROMPTS[8] = PROMPTS[0][:32] + [99, 98]  # hits the first prompt's cached blocks
ARRIVALS = [0, 0, 0, 1, 1, 2, 2, 3, 12, 4]


def workload(stop_token: int | None) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    stops = () if stop_token is None else (stop_token,)
    sampled = dict(temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True)
    return [
        greedy,
        SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, stop_token_ids=stops),
        SamplingParams(max_new_tokens=10, seed=7, **sampled),
        SamplingParams(temperature=0.0, max_new_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True),  # stopped downstream at 3
        SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True),  # aborted at 2
        SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
        SamplingParams(max_new_tokens=9, seed=3, presence_penalty=0.7, **sampled),
    ]


@dataclass
class Seen:
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    scheduled_at: set = field(default_factory=set)  # what its outputs said of its first step
    added_at: float = 0.0


def serve(
    device: str,
    async_scheduling: bool,
    params: list[SamplingParams],
    watch: Callable[[LLMEngine], None] = lambda e: None,
    kv_cache_dtype: str = "auto",
    select: bool = False,
) -> tuple[dict[str, Seen], LLMEngine]:
    engine = LLMEngine(
        EngineArgs(
            model=str(fixture_path("llama")),
            device=device,
            dtype="float32",
            cuda_graphs=True,
            max_num_batched_tokens=32,
            block_size=8,
            num_blocks=20,
            async_scheduling=async_scheduling,
            kv_cache_dtype=kv_cache_dtype,
            # Selecting: decoding sequences past 16 tokens attend over 4 blocks of 8 (the first, the
            # last, and two chosen), so most decode steps drop blocks.
            decode_attention_budget=32 if select else 0,
            decode_attention_min_context=16,
        )
    )
    watch(engine)
    seen = {f"r{i}": Seen() for i in range(len(PROMPTS))}
    for step in range(500):
        for i, arrival in enumerate(ARRIVALS):
            if arrival == step:
                seen[f"r{i}"].added_at = time.monotonic()
                engine.add_request(f"r{i}", PROMPTS[i], params[i])
        if step > max(ARRIVALS) and not engine.needs_step():
            return seen, engine
        for out in engine.step():
            got = seen[out.request_id]
            got.tokens += out.new_token_ids
            got.logprobs += out.new_logprobs or []
            got.prompt_logprobs = out.prompt_logprobs or got.prompt_logprobs
            got.finish_reason = out.finish_reason
            got.scheduled_at.add(out.scheduled_at)
            # What the router does on a stop string, and what a client going away does.
            if out.request_id == "r6" and len(got.tokens) == 3 and not out.finished:
                engine.finish_request("r6", "stop_sequence")
                got.finish_reason = "stop_sequence"
            if out.request_id == "r7" and len(got.tokens) == 2:
                engine.abort_requests(["r7"])
                got.finish_reason = "abort"
    raise AssertionError("the workload did not finish")


def penalties_see_every_token(engine: LLMEngine) -> None:
    """Fails the run if the sampler is handed a penalised row whose output has a token in flight."""
    sample = engine.runner.sampler.__call__

    def checked(logits, rows, mask=None):
        for row in rows:
            assert PLACEHOLDER not in row.output_token_ids, "penalties applied without the last token"
        penalised[0] += sum(bool(row.output_token_ids) for row in rows)
        return sample(logits, rows, mask)

    penalised = engine.penalised_rows = [0]
    engine.runner.sampler = checked


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


# On CUDA the tokens in flight are read back through pinned copies and events, and decode steps
# replay CUDA graphs whose inputs come from the previous step's device tensor.
@pytest.fixture(
    scope="module",
    params=[
        ("cpu", "auto"),
        ("cpu", "fp8"),
        ("cpu", "auto", "select"),
        ("cpu", "fp8", "select"),
        ("cpu", "int8", "select"),
        pytest.param(("cuda", "auto"), marks=ON_GPU),
        pytest.param(("cuda", "fp8"), marks=ON_GPU),
        pytest.param(("cuda", "fp8", "select"), marks=ON_GPU),
        pytest.param(("cuda", "int8", "select"), marks=ON_GPU),
    ],
    ids=lambda p: "-".join(p),
)
def runs(request) -> tuple[dict[str, Seen], dict[str, Seen], LLMEngine]:
    """(synchronous, overlapped, the overlapped run's engine); the engine also says, as
    `tokens_may_differ`, whether the two runs may pick different tokens."""
    device, kv, *select = request.param
    options = dict(kv_cache_dtype=kv, select=bool(select))
    unstopped, _ = serve(device, False, workload(None), **options)
    stop_token = unstopped["r1"].tokens[3]  # r1 stops on its 4th token
    synchronous, _ = serve(device, False, workload(stop_token), **options)
    overlapped, engine = serve(device, True, workload(stop_token), watch=penalties_see_every_token, **options)
    assert engine.shard.specs[0].scaled == (kv != "auto")
    assert (engine.shard.selection is not None) == bool(select)
    assert engine.penalised_rows[0] > 10
    # An 8-bit cache's keys are read quantized by every step but a fresh prompt's own (which attends
    # over them unquantized), so where the two loops chunk a prompt differently its logits differ
    # in the last digits; selection can turn such a difference into another block, and a sampled
    # request into other tokens. Then only the requests' lengths and finishes must agree.
    engine.tokens_may_differ = kv != "auto" and bool(select)
    return synchronous, overlapped, engine


def test_every_request_gets_the_same_tokens_and_finish(runs) -> None:
    synchronous, overlapped, engine = runs
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.block_manager.prefix_cache_hits > 0
    assert synchronous["r1"].finish_reason == "stop_sequence" and len(synchronous["r1"].tokens) == 4
    assert len(synchronous["r6"].tokens) == 3 and len(synchronous["r7"].tokens) == 2
    for request_id, expected in synchronous.items():
        got = overlapped[request_id]
        assert (len(got.tokens), got.finish_reason) == (len(expected.tokens), expected.finish_reason), (
            request_id
        )
        assert engine.tokens_may_differ or got.tokens == expected.tokens, request_id


def test_outputs_say_when_their_request_was_first_scheduled(runs) -> None:
    """The time a request's queueing ended, the same in each of its outputs, preempted or not."""
    for seen in runs[:2]:
        for request_id, got in seen.items():
            assert len(got.scheduled_at) == 1 and None not in got.scheduled_at, request_id
            assert got.added_at <= min(got.scheduled_at) <= time.monotonic(), request_id


def test_steps_are_timed_by_kind(runs) -> None:
    """The workload's prompts (chunked, and resumed after preemption) and its decode steps."""
    steps = {d.method: d for d in runs[2].stats().step_durations}
    assert steps["prefill"].count >= len(PROMPTS) and steps["decode"].count >= 10
    assert steps["prefill"].sum_s > 0 and steps["decode"].sum_s > 0


def test_logprobs_and_prompt_logprobs_are_the_same(runs) -> None:
    synchronous, overlapped, engine = runs
    for request_id in ("r4", "r5"):
        expected, got = synchronous[request_id], overlapped[request_id]
        assert len(got.logprobs) == len(expected.logprobs)
        if engine.tokens_may_differ:
            continue
        for a, b in zip(got.logprobs, expected.logprobs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    expected, got = synchronous["r5"].prompt_logprobs, overlapped["r5"].prompt_logprobs
    assert got is not None and len(got) == len(PROMPTS[5]) and got[0] is None
    assert [e.token_id for e in got[1:]] == [e.token_id for e in expected[1:]]
    assert [e.logprob for e in got[1:]] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-5)


def test_outputs_come_one_step_late_and_nothing_is_left_behind(runs) -> None:
    _, _, engine = runs
    assert not engine.needs_step() and engine.runner.requests == {}
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_blocks
    engine.add_request("late", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its token is read by the next step
    first = engine.step()
    assert [(o.request_id, len(o.new_token_ids)) for o in first] == [("late", 1)]
