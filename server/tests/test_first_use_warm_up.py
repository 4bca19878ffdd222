"""The engine's warm-up requests: the step shapes they exist for, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine import warm_up as first_use_warm_up
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.engine.warm_up import cudnn_prompt_length, warm_up, warm_up_prompts
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.fixtures import fixture_path


def cpu_engine(warm: bool, **overrides) -> LLMEngine:
    """The llama fixture on the CPU, 40 blocks of 8 tokens unless overridden."""
    args = dict(model=str(fixture_path("llama")), device="cpu", dtype="float32", block_size=8, num_blocks=40)
    return LLMEngine(EngineArgs(**{**args, **overrides}, warm_up=warm))


def greedy_tokens(engine: LLMEngine, prompt: list[int], new: int = 8) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))
    tokens = []
    while engine.needs_step():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def warm_up_prompt_steps(engine: LLMEngine) -> list:
    """Run the warm-up on `engine`; the scheduler outputs of its steps that start new requests."""
    steps = []
    launch = engine.runner.launch

    def recorded(scheduler_output):
        steps.append(scheduler_output)
        return launch(scheduler_output)

    engine.runner.launch = recorded
    warm_up(engine, engine.num_blocks, None)
    return [s for s in steps if s.scheduled_new_requests]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_runs_a_lone_prompt_fresh_prompts_together_then_one_beside_decode_rows(async_scheduling):
    prompt_steps = warm_up_prompt_steps(cpu_engine(False, async_scheduling=async_scheduling))
    assert len(prompt_steps) == 3
    lone, fresh, mixed = prompt_steps
    ids = lambda requests: [r.request_id for r in requests]  # noqa: E731
    assert ids(lone.scheduled_new_requests) == ["tgserve-warm-up-0"] and not lone.scheduled_cached_requests
    assert ids(fresh.scheduled_new_requests) == ["tgserve-warm-up-1", "tgserve-warm-up-2"]
    assert not fresh.scheduled_cached_requests
    assert ids(mixed.scheduled_new_requests) == ["tgserve-warm-up-3"]
    assert ids(mixed.scheduled_cached_requests) == ["tgserve-warm-up-1", "tgserve-warm-up-2"]
    assert all(mixed.num_scheduled_tokens[f"tgserve-warm-up-{i}"] == 1 for i in (1, 2))  # decode rows
    lengths = [len(r.token_ids) for s in prompt_steps for r in s.scheduled_new_requests]
    # Multiples of 16, the long one as long as the room allows (160 tokens: 40 blocks of 8, half
    # the pool); then two that are not.
    assert lengths == [144, 32, 35, 37]


def test_warm_up_runs_a_lone_prompt_of_cudnn_length_where_one_step_holds_it(monkeypatch):
    """The CUDNN_ALONE prompt runs alone, whole in one step, after the first lone prompt (its length
    lowered here so the CPU fixture can hold it)."""
    monkeypatch.setattr(first_use_warm_up, "CUDNN_ALONE", 41)
    engine = cpu_engine(False, max_num_batched_tokens=64)
    prompt_steps = warm_up_prompt_steps(engine)
    cudnn = prompt_steps[1]
    assert [r.request_id for r in cudnn.scheduled_new_requests] == ["tgserve-warm-up-cudnn"]
    assert not cudnn.scheduled_cached_requests and cudnn.num_scheduled_tokens["tgserve-warm-up-cudnn"] == 41
    assert len(prompt_steps) == 4
    assert not engine.needs_step() and engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.parametrize(
    "budget,room,sparse_min,expected",
    [
        (16384, 131072, 32768, first_use_warm_up.CUDNN_ALONE),
        (16384, 131072, None, first_use_warm_up.CUDNN_ALONE),
        (2048, 131072, None, None),  # the default budget chunks it: the paged kernel, never cuDNN
        (16384, 8192, None, None),  # no room for it
        (16384, 131072, 8192, None),  # sparse below it: no dense lone prompt that long
    ],
)
def test_cudnn_prompt_only_where_a_lone_prompt_can_meet_cudnn(budget, room, sparse_min, expected):
    assert cudnn_prompt_length(budget, room, sparse_min) == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_leaves_no_request_no_count_and_the_same_tokens(async_scheduling):
    """Nothing the metrics read is left from the warm-up: under async scheduling the last step it
    read is a decode step of one row."""
    warmed = cpu_engine(True, async_scheduling=async_scheduling)
    cold = cpu_engine(False, async_scheduling=async_scheduling)
    assert not warmed.needs_step()
    stats = warmed.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (0, 0, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert (stats.step_num_tokens, stats.step_num_seqs) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    prompt = list(range(20, 45))
    assert greedy_tokens(warmed, prompt) == greedy_tokens(cold, prompt)


@pytest.mark.parametrize("asked,runs", [(None, False), (True, True), (False, False)])
def test_warm_up_is_for_gpus_unless_asked(asked, runs, monkeypatch):
    """On the CPU (None: the device decides) nothing compiles on first use: no warm-up."""
    from tgserve.server.engine import llm_engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "warm_up", lambda engine, *limits: calls.append(engine) or 0.0)
    cpu_engine(asked)
    assert len(calls) == int(runs)


@pytest.mark.parametrize(
    "limits",
    [dict(max_num_seqs=1, max_num_batched_tokens=32), dict(num_blocks=6, block_size=4)],
    ids=["one-sequence-at-a-time", "six-blocks"],
)
def test_warm_up_finishes_within_tight_limits(limits):
    """One sequence at a time, the pair cannot run together; in a six-block pool the prompts shrink:
    either way the warm-up ends with every block free."""
    stats = cpu_engine(True, **limits).stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("room", [4, 10, 64, 4096])
def test_warm_up_prompts_leave_room_for_their_new_tokens(room):
    for prompt in warm_up_prompts(16, room, 50):
        assert 1 <= len(prompt) <= max(1, room - 5)
        assert all(0 <= token < 50 for token in prompt)


# Run in a fresh process: Triton's in-memory kernels are per process, so earlier tests in this one
# would hide a kernel the warm-up misses. The hook sees every compile that first use would pay for
# (it runs before Triton looks in its disk cache).
AFTER_WARM_UP = r"""
import json, sys
import triton
from tgserve.kernels.testing import compiled_kernel_name
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams

engine = LLMEngine(EngineArgs(model=sys.argv[1], device="cuda", block_size=16, num_blocks=256, max_num_seqs=16))
compiled = []

def record(*args, fn=None, key=None, **kwargs):
    compiled.append(f'{compiled_kernel_name(fn)} {key}')
    return False

triton.knobs.runtime.jit_cache_hook = record
greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1, max_new_tokens=8, ignore_eos=True)
batches = [[(100, greedy)], [(333, greedy)], [(487, greedy)], [(50, sampled), (200, greedy), (301, sampled), (450, greedy)]]
for n, batch in enumerate(batches):
    for i, (length, params) in enumerate(batch):
        engine.add_request(f"r{n}-{i}", [(97 * t + length) % 200 + 3 for t in range(length)], params)
    while engine.needs_step():
        engine.step()
print(json.dumps(compiled))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_after_warm_up_common_requests_compile_no_kernel():
    """Lone prompts short and past the decode kernel's split length, then prompts of several
    lengths together, greedy and sampled, decoding side by side: nothing left to compile."""
    model = fixture_path("llama")
    done = subprocess.run([sys.executable, "-P", "-c", AFTER_WARM_UP, str(model)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert not compiled, "\n".join(compiled)
