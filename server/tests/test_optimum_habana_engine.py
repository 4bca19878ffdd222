"""`StaticBatchEngine`, the optimum-habana fallback's serving engine, on CPU.

On CPU, `load_fallback_model` builds the plain transformers class (`GPTBigCodeForCausalLM`,
`LlamaForCausalLM`, `GPT2LMHeadModel`) where a Gaudi gets optimum-habana's Gaudi class; the static
cache is the family's layout (GPT-BigCode's fused multi-query, per-layer tuples for Llama and GPT-2,
the latter a real fallback case: no native implementation). Three rows of 24 positions serve
requests arriving at different steps with prompts of 4 to 19 tokens and different budgets, so rows
finish at different steps and are filtered, waiting requests go into freed rows (longer prompts
shifting the batch right), the batch shifts left at the static length, one request is aborted while
running and one while waiting, one stops on a stop token and one at the static length. Each
request's tokens equal transformers `generate` on its prompt alone (greedy, float32); seeded sampling
with penalties and logprobs equals `LLMEngine`'s on the same requests.

Static shapes: prompts are left-padded to buckets of 8 (so to 8, 16 or 23 tokens, padded by 1 to 6),
and after warmup the staggered run meets no forward input shape that warmup did not; with warmup
off, the shape log counts every shape served as new (so the check can fail).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tgserve.server.config.buckets import BucketConfig
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm import LLM
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.description import load_model_description
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.models.registry import UnsupportedModelError
from tgserve.server.optimum_habana.cache_layouts import FusedMultiQuery, PerLayerKV
from tgserve.server.optimum_habana.engine import StaticBatchEngine
from tgserve.server.optimum_habana.fallback_model import fallback_needed
from tgserve.server.optimum_habana.static_batch import prompt_buckets
from tgserve.server.protocol.outputs import RequestOutput
from tgserve.server.protocol.params import InvalidRequestError, SamplingParams
from tgserve.server.static_shapes.padding import ShapeLog
from tgserve.server.testing.arch_sweep import saved_tiny_model
from tgserve.server.testing.fixtures import CHECK_PROMPTS, fixture_path, single_threaded_torch

from .parity import reference_greedy

LAYOUTS = {"gpt_bigcode": FusedMultiQuery, "llama": PerLayerKV, "gpt2": PerLayerKV}
PROMPTS = [*CHECK_PROMPTS, "def fib(n):\n    return"]  # 7, 5, 7, 17, 19, 4 and 10 tokens
ROWS, MAX_LEN = 3, 24
BUCKETS = BucketConfig(token_step=8)  # prompts padded to 8, 16 or 23 tokens
DECODE_SHAPE = ((ROWS, 1), (ROWS, MAX_LEN + 1), MAX_LEN)  # input_ids, attention mask, cache width


@pytest.fixture(autouse=True)
def _one_thread():
    with single_threaded_torch():
        yield


def static_engine(arch: str, buckets: BucketConfig = BucketConfig()) -> StaticBatchEngine:
    args = EngineArgs(
        model=str(fixture_path(arch)),
        device="cpu",
        max_num_seqs=ROWS,
        max_model_len=MAX_LEN,
        static_shapes=True,  # the default on a Gaudi
        buckets=buckets,
    )
    return StaticBatchEngine(args, load_model_description(args))


def prefill_widths(log: ShapeLog) -> set[int]:
    """The padded prompt lengths the served prefills ran at."""
    return {input_ids[1] for input_ids, _, width in log.served if width == 0}


@functools.cache
def prompts(arch: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(fixture_path(arch))
    return [tokenizer(text)["input_ids"] for text in PROMPTS]


@functools.cache
def reference_model(arch: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(fixture_path(arch), **dtype_kwargs(torch.float32)).eval()


@functools.cache
def generate_alone(arch: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, on the prompt alone, stopping at EOS as the engine does."""
    model = reference_model(arch)
    return reference_greedy(model, list(prompt), max_new_tokens, model.config.eos_token_id)


@dataclass
class Tracked:
    """What the driver saw of one request."""

    tokens: list[int] = field(default_factory=list)
    deltas: list[RequestOutput] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the step of each delta
    aborted_with: int | None = None  # tokens received when it was aborted


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


def drive(engine: Any, arrivals: list[Arrival], aborts: dict[str, tuple[int, int]]) -> dict[str, Tracked]:
    """Step `engine` until idle, adding each request at its step; `aborts[id] = (step, tokens)` aborts
    a request at the first step from `step` on at which it has received `tokens` tokens."""
    seen: dict[str, Tracked] = defaultdict(Tracked)
    pending = sorted(arrivals, key=lambda a: a.step)
    step = 0
    while pending or engine.needs_step():
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            engine.add_request(arrival.request_id, arrival.prompt, arrival.params)
        for request_id, (from_step, tokens) in aborts.items():
            tracked = seen[request_id]
            finished = bool(tracked.deltas) and tracked.deltas[-1].finished
            if (
                step >= from_step
                and len(tracked.tokens) >= tokens
                and tracked.aborted_with is None
                and not finished
            ):
                engine.abort_requests([request_id])
                tracked.aborted_with = len(tracked.tokens)
        for output in engine.step():
            tracked = seen[output.request_id]
            tracked.tokens += output.new_token_ids
            tracked.deltas.append(output)
            tracked.steps.append(step)
        step += 1
        assert step < 200, "the engine never went idle"
    return seen


def greedy(max_new_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kwargs)


@pytest.mark.parametrize("arch", list(LAYOUTS))
def test_staggered_requests_each_get_what_they_get_alone(arch: str) -> None:
    engine = static_engine(arch, BUCKETS)
    assert type(engine.batch.cache.layout) is LAYOUTS[arch]
    log = engine.batch.shapes
    assert len(log.seen) == 4 and not log.served  # warmup: 3 prompt buckets and the decode step
    assert engine.batch.cache.end == 0 and not engine.batch.cache.mask.any()  # it wrote nothing
    assert type(engine.batch.model) is type(reference_model(arch))  # the plain transformers class
    p = prompts(arch)
    stop_ref = generate_alone(arch, tuple(p[5]), 11)
    stop_at = next(k for k in range(2, 11) if stop_ref[k] not in stop_ref[:k])
    plan = [  # (step, id, prompt, params)
        Arrival(0, "a", p[0], greedy(9)),
        Arrival(0, "b", p[1], greedy(4)),
        Arrival(0, "c", p[2], greedy(12)),
        Arrival(1, "d", p[3], greedy(6)),  # 17 + 6 fills 23 positions: the batch must shift left
        Arrival(1, "waits-then-aborted", p[0], greedy(5)),
        Arrival(2, "e", p[4], greedy(11)),  # 19 + 11 > 24: stops at the static length
        Arrival(4, "f", p[5], greedy(11, stop_token_ids=(stop_ref[stop_at],))),
        Arrival(5, "g", p[6], greedy(8)),
        Arrival(5, "aborted-running", p[2], greedy(20)),
    ]
    seen = drive(engine, plan, {"waits-then-aborted": (2, 0), "aborted-running": (0, 3)})

    for arrival in plan:
        tracked = seen[arrival.request_id]
        budget = min(arrival.params.max_new_tokens, MAX_LEN - len(arrival.prompt))
        want = generate_alone(arch, tuple(arrival.prompt), budget)
        assert len(set(tracked.steps)) == len(tracked.steps), "one token per request per step"
        assert all(len(d.new_token_ids) == 1 for d in tracked.deltas)
        stamps = {d.scheduled_at for d in tracked.deltas}  # when its queueing ended, in every delta
        assert not tracked.deltas or (len(stamps) == 1 and None not in stamps)
        if arrival.request_id.endswith("aborted"):
            assert tracked.aborted_with == 0 and not tracked.deltas  # never left the queue
            continue
        if arrival.request_id == "aborted-running":
            assert tracked.aborted_with == 3 and tracked.tokens == want[:3]  # nothing after the abort
            assert not tracked.deltas[-1].finished
            continue
        reason = "stop_sequence" if arrival.request_id == "f" else "length"
        if arrival.request_id == "f":
            want = stop_ref[: stop_at + 1]
        assert tracked.tokens == want, f"{arrival.request_id} ({len(arrival.prompt)} prompt tokens)"
        assert [d.finished for d in tracked.deltas] == [False] * (len(want) - 1) + [True]
        assert tracked.deltas[-1].finish_reason == reason
        assert tracked.deltas[-1].num_output_tokens == len(want)
    assert len(seen["e"].tokens) == MAX_LEN - len(p[4]) < 11  # the static length stopped it
    assert sum(len(set(generate_alone(arch, tuple(x), 8))) for x in p) > 20  # not a degenerate model
    events = engine.batch.events
    assert events["insert"] > ROWS and events["filter"] >= 2, events
    assert events["shift_left"] >= 1 and events["shift_right"] >= 1, events
    assert log.after_warmup == 0 and log.served == log.seen, log.served ^ log.seen
    assert prefill_widths(log) == {8, 16, 23} and DECODE_SHAPE in log.served
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and not engine.needs_step()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.num_total_blocks) == (
        0,
        0,
        3,
        3,
    )
    # Every step that decoded or admitted was timed: those are the steps that reported tokens.
    steps = {d.method: d.count for d in stats.step_durations}
    assert steps["prefill"] >= 4 and steps["decode"] >= 4
    assert sum(steps.values()) == len(set().union(*(tracked.steps for tracked in seen.values())))


def test_without_warmup_the_shape_log_counts_the_shapes_served() -> None:
    """Exponential buckets from 4 (4, 8, 16, 23): prompts of 4, 5, 10 and 19 tokens meet each one."""
    engine = static_engine("llama", BucketConfig(scheme="exponential", token_step=4, warmup=False))
    assert not engine.batch.shapes.seen
    p = prompts("llama")
    plan = [Arrival(i, f"r{i}", p[k], greedy(5)) for i, k in enumerate([5, 1, 6, 4])]
    seen = drive(engine, plan, {})
    for arrival in plan:
        want = generate_alone("llama", tuple(arrival.prompt), min(5, MAX_LEN - len(arrival.prompt)))
        assert seen[arrival.request_id].tokens == want, len(arrival.prompt)
    log = engine.batch.shapes
    assert prefill_widths(log) == {4, 8, 16, 23} and DECODE_SHAPE in log.served
    assert log.after_warmup == len(log.served) == len(log.seen) == 5  # every one a compile while serving


def test_prompt_buckets_follow_the_scheme_where_static_shapes_are_on() -> None:
    args = EngineArgs(model=str(fixture_path("gpt2")), device="cpu", max_num_seqs=ROWS, max_model_len=MAX_LEN)
    off = StaticBatchEngine(args)  # static shapes are off by default off a Gaudi
    assert off.batch.prompt_buckets == list(range(1, MAX_LEN)) and not off.batch.shapes.seen
    assert prompt_buckets(BUCKETS, MAX_LEN) == [8, 16, 23]
    assert prompt_buckets(BucketConfig(), MAX_LEN) == [23]  # token_step 128: everything pads to 23
    assert prompt_buckets(BucketConfig(scheme="exponential", token_step=4), MAX_LEN) == [4, 8, 16, 23]
    assert prompt_buckets(BucketConfig(), 4096)[:2] == [128, 256]
    assert prompt_buckets(BucketConfig(), 4096)[-2:] == [3968, 4095]  # the longest prompt that fits


SAMPLED = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_new_tokens=10, logprobs=2),
    SamplingParams(temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.5, seed=3, max_new_tokens=9),
    SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=1, prompt_logprobs=2, presence_penalty=0.4),
    SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_new_tokens=10, prompt_logprobs=0),
]


def run_all(engine: Any, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, Tracked]:
    arrivals = [Arrival(0, f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
    return drive(engine, arrivals, {})


@pytest.mark.parametrize("arch", list(LAYOUTS))
def test_sampling_matches_the_paged_engine(arch: str) -> None:
    """Seeded rows draw their noise from (seed, step), so the same request samples the same tokens
    on the static engine (3 rows: the fourth request waits) and on `LLMEngine` (all four at once)."""
    p = prompts(arch)
    requests = list(zip([p[0], p[1], p[2], p[5]], SAMPLED, strict=True))
    static = run_all(static_engine(arch), requests)
    paged_args = EngineArgs(model=str(fixture_path(arch)), device="cpu", block_size=8, num_blocks=64)
    paged = run_all(LLMEngine(paged_args), requests)
    for request_id, want in paged.items():
        got = static[request_id]
        assert got.tokens == want.tokens, request_id
        assert got.deltas[-1].finish_reason == want.deltas[-1].finish_reason
        for mine, theirs in zip(got.deltas, want.deltas, strict=True):
            assert_logprobs_close(mine.new_logprobs, theirs.new_logprobs)
            assert_logprobs_close(mine.prompt_logprobs, theirs.prompt_logprobs)
    assert static["r2"].deltas[0].prompt_logprobs is not None


def assert_logprobs_close(mine: list | None, theirs: list | None) -> None:
    assert (mine is None) == (theirs is None)
    for a, b in zip(mine or [], theirs or [], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_bad_requests_are_refused_naming_the_limit() -> None:
    engine = static_engine("llama")
    cases = {
        "static cache holds 24 positions": [5] * MAX_LEN,
        "prompt is empty": [],
        "outside the vocabulary": [5, engine.vocab_size],
    }
    for message, prompt in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("bad", prompt, greedy(3))
    engine.add_request("ok", [5] * (MAX_LEN - 1), greedy(3))  # the longest prompt that fits
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok", [5], greedy(3))
    seen = drive(engine, [], {})
    assert seen["ok"].tokens and seen["ok"].deltas[-1].finish_reason == "length"
    assert len(seen["ok"].tokens) == 1  # 23 prompt tokens + 1 reach the static length


def test_the_offline_api_runs_on_the_static_engine() -> None:
    """`LLM.from_engine` drives the static engine with `LLM.generate`'s loop, stop strings included
    (they end requests through `finish_request`)."""
    llm = LLM.from_engine(static_engine("gpt_bigcode"))
    texts = [PROMPTS[0], PROMPTS[2], PROMPTS[5], PROMPTS[1]]
    results = llm.generate(texts, greedy(7))
    p = prompts("gpt_bigcode")
    for text, result in zip(texts, results, strict=True):
        assert result.token_ids == generate_alone("gpt_bigcode", tuple(p[PROMPTS.index(text)]), 7)
        assert result.finish_reason == "length"
    full = llm.tokenizer.decode(results[0].token_ids, skip_special_tokens=True)
    stop = full.strip()[:2]
    stopped = llm.generate(texts[0], greedy(7, stop=(stop,)))[0]
    assert stopped.finish_reason == "stop_sequence" and stopped.text == full[: full.find(stop)]
    assert not llm.engine.has_unfinished_requests()
    llm.engine.step()  # frees the row of the request the stop string ended
    assert not llm.engine.needs_step() and llm.engine.stats().num_free_blocks == ROWS


def test_fallback_is_for_gaudi_architectures_without_a_native_implementation() -> None:
    gpt2, llama = (AutoConfig.from_pretrained(fixture_path(arch)) for arch in ("gpt2", "llama"))
    assert fallback_needed(gpt2, "hpu") and fallback_needed(gpt2, torch.device("hpu"))
    assert not fallback_needed(llama, "hpu")  # native: the paged hpu backend serves it
    assert not fallback_needed(gpt2, "cpu") and not fallback_needed(gpt2, "cuda")
    mixtral = transformers.MixtralConfig(architectures=["MixtralForCausalLM"])  # native on CUDA and CPU only
    assert fallback_needed(mixtral, "hpu") and not fallback_needed(mixtral, "cuda")
    # build_engine's choice reads the description once and hands it on (no Gaudi is touched here)
    on_hpu = load_model_description(EngineArgs(model=str(fixture_path("gpt2")), device="hpu"))
    assert fallback_needed(on_hpu.config, on_hpu.device)


def test_serving_on_cpu_imported_no_habana_module() -> None:
    assert not [m for m in sys.modules if m.startswith(("habana_frameworks", "optimum"))]


def test_the_engine_process_describes_it_as_rows_of_one_block() -> None:
    from tgserve.server.engine.service import ready_message

    ready = ready_message(static_engine("gpt2"), "")
    assert (ready.max_model_len, ready.num_total_blocks, ready.block_size) == (MAX_LEN, ROWS, MAX_LEN)
    assert ready.device == "cpu" and ready.dtype == "float32" and ready.eos_token_ids


def test_sliding_windows_narrower_than_the_rows_are_refused_and_narrow_rows_are_exact(tmp_path) -> None:
    """transformers' sliding-window masks count the static rows' columns, not positions (a decode
    token sits after the whole width): a window that does not span the rows is refused by name."""
    hf_model = saved_tiny_model("mistral", "MistralForCausalLM", tmp_path)  # a 16-token window
    assert hf_model.config.sliding_window == 16
    wide = EngineArgs(model=str(tmp_path), device="cpu", max_num_seqs=2, max_model_len=24, static_shapes=True)
    with pytest.raises(
        UnsupportedModelError, match=r"sliding-window attention \(16 tokens\).*--max-total-tokens 15"
    ):
        StaticBatchEngine(wide, load_model_description(wide))
    narrow = dataclasses.replace(wide, max_model_len=15)
    engine = StaticBatchEngine(narrow, load_model_description(narrow))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    engine.add_request("r", prompt, greedy(7, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [token for out in engine.step() for token in out.new_token_ids]
    assert tokens == reference_greedy(hf_model, prompt, 7)
