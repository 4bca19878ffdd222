"""Scheduler: chunked prefill, FCFS admission, preemption, prefix caching, aborts and stop rules.

A fake runner mirrors what the model runner does with a SchedulerOutput: it keeps its own copy of
each request's tokens and block table, "writes KV" (the token id) into the slots it computes, and
reads the whole context back from those slots before it samples. A block that is shared, evicted or
overwritten wrongly therefore shows up as a wrong context, and the outputs are compared with a
request generated alone.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tgserve.server.config.scheduler import SchedulerConfig
from tgserve.server.core.request import FinishReason, Request, RequestStatus
from tgserve.server.core.scheduler import Scheduler
from tgserve.server.core.scheduler_output import SchedulerOutput
from tgserve.server.core.step_timing import step_kind
from tgserve.server.protocol.params import SamplingParams

Model = Callable[[list[int]], int]


def next_token(context: list[int]) -> int:
    """A deterministic 'model': the next token depends on every token of the context, in order."""
    acc = 0
    for token in context:
        acc = (acc * 31 + token) % 1_000_003
    return 10 + acc % 500


def reference(prompt: list[int], max_new_tokens: int, model: Model = next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(model(tokens))
    return tokens[len(prompt) :]


@dataclass
class _RunnerState:
    tokens: list[int]
    blocks: list[int]
    computed: int


class FakeRunner:
    """Applies SchedulerOutputs the way the model runner does, with token ids standing in for KV."""

    def __init__(self, scheduler: Scheduler, model: Model = next_token) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.config.block_size
        self.model = model
        self.kv: dict[int, int] = {}  # slot -> token id whose KV is stored there
        self.host_kv: dict[int, int] = {}  # the host tier's slots, likewise
        self.states: dict[str, _RunnerState] = {}

    def _slot(self, state: _RunnerState, pos: int) -> int:
        return state.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _read(self, slot: int) -> int | None:
        """A slot's token; slots of blocks past the pool's are host blocks (spilled ones)."""
        device_slots = self.scheduler.config.num_blocks * self.block_size
        return self.kv.get(slot) if slot < device_slots else self.host_kv.get(slot - device_slots)

    def _copy_blocks(self, source: dict[int, int], target: dict[int, int], pairs) -> None:  # noqa: ANN001
        for from_block, to_block in pairs:
            for offset in range(self.block_size):
                target[to_block * self.block_size + offset] = source.get(
                    from_block * self.block_size + offset
                )

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self._copy_blocks(
            self.kv, self.host_kv, out.kv_transfers.offloads
        )  # before the step, as the runner does
        self._copy_blocks(self.host_kv, self.kv, out.kv_transfers.loads)
        for request_id in out.finished_request_ids:
            self.states.pop(request_id, None)
        for new in out.scheduled_new_requests:
            assert new.request_id not in self.states
            self.states[new.request_id] = _RunnerState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in out.scheduled_cached_requests:
            state = self.states[cached.request_id]
            assert state.computed == cached.num_computed_tokens
            for index, block_id in cached.moved_blocks:
                state.blocks[index] = block_id
            state.blocks.extend(cached.new_block_ids)
        sampled = {}
        for request_id, num in out.num_scheduled_tokens.items():
            state = self.states[request_id]
            assert 0 < num and state.computed + num <= min(
                len(state.tokens), len(state.blocks) * self.block_size
            )
            for pos in range(state.computed, state.computed + num):
                assert state.blocks[pos // self.block_size] < self.scheduler.config.num_blocks, (
                    "a write to host"
                )
                self.kv[self._slot(state, pos)] = state.tokens[pos]
            state.computed += num
            if state.computed == len(state.tokens):
                context = [self._read(self._slot(state, pos)) for pos in range(state.computed)]
                assert context == state.tokens, f"KV of {request_id} was corrupted"
                state.tokens.append(self.model(context))
                sampled[request_id] = state.tokens[-1]
        return sampled


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    config = sched.config
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    whole = [
        new
        for new in out.scheduled_new_requests
        if config.whole_prompt_tokens
        and out.num_scheduled_tokens[new.request_id] >= config.whole_prompt_tokens
    ]
    if whole:  # a whole prompt: alone in its step, every token of it computed there
        assert list(out.num_scheduled_tokens) == [whole[0].request_id] and whole[0].num_computed_tokens == 0
        assert out.total_num_scheduled_tokens == len(whole[0].token_ids)
    else:
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert sched.num_running <= config.max_num_seqs
    for request_id in out.num_scheduled_tokens:
        request = sched.get_request(request_id)
        assert request is not None and request.status == RequestStatus.RUNNING
    for data in [*out.scheduled_new_requests, *out.scheduled_cached_requests]:
        # Scheduled tokens count as computed at once; the request data say where the step starts.
        num_after = data.num_computed_tokens + out.num_scheduled_tokens[data.request_id]
        assert num_after == sched.get_request(data.request_id).num_computed_tokens
    bm = sched.block_manager
    owned = {b for r in sched.running for b in bm.get_block_ids(r.request_id) if b < bm.num_total_blocks}
    assert len(owned) + bm.num_free_blocks == bm.num_total_blocks
    assert all(not bm.get_block_ids(r.request_id) for r in sched.waiting)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    check_invariants(sched, out)
    return out, sched.update_from_output(out, runner.execute(out))


def run(
    sched: Scheduler, runner: FakeRunner, arrivals: dict[int, list[Request]] | None = None
) -> list[SchedulerOutput]:
    """Step until every request (including those arriving at later steps) has finished."""
    arrivals = dict(arrivals or {})
    outputs = []
    for i in range(10_000):
        for request in arrivals.pop(i, []):
            sched.add_request(request)
        if not arrivals and not sched.has_unfinished_requests():
            return outputs
        outputs.append(step(sched, runner)[0])
    raise AssertionError("did not finish")


def make(request_id: str, prompt: list[int], max_new_tokens: int = 4, **params) -> Request:
    eos = params.pop("eos", frozenset())
    return Request(
        request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens, **params), eos_token_ids=eos
    )


def setup(**config) -> tuple[Scheduler, FakeRunner]:
    config = {"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 64, **config}
    sched = Scheduler(SchedulerConfig(**config))
    return sched, FakeRunner(sched)


def test_scheduler_and_block_manager_never_import_torch() -> None:
    code = "import sys, tgserve.server.core.scheduler, tgserve.server.core.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefill_then_one_token_per_decode_until_length() -> None:
    sched, runner = setup()
    request = make("a", list(range(10)), max_new_tokens=5)
    sched.add_request(request)
    out, updated = step(sched, runner)
    assert [n.token_ids for n in out.scheduled_new_requests] == [list(range(10))]
    assert out.num_scheduled_tokens == {"a": 10} and updated == [request] and request.num_output_tokens == 1
    for _ in range(4):
        out, _ = step(sched, runner)
        assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_new_requests
    assert request.finish_reason == FinishReason.LENGTH and request.is_finished
    assert request.output_token_ids == reference(list(range(10)), 5)
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished_requests()
    assert sched.get_request("a") is None and sched.has_finished_requests()
    assert sched.schedule().finished_request_ids == {"a"} and not sched.has_finished_requests()


def test_chunked_prefill_under_a_small_budget() -> None:
    sched, runner = setup(max_num_batched_tokens=16)
    request = make("a", list(range(50)), max_new_tokens=2)
    sched.add_request(request)
    for start, num in [(0, 16), (16, 16), (32, 16), (48, 2)]:
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"a": num} and request.num_computed_tokens == start + num
        data = (out.scheduled_new_requests or out.scheduled_cached_requests)[0]
        assert data.num_computed_tokens == start
        updated = sched.update_from_output(out, runner.execute(out))
        assert updated == ([request] if num == 2 else [])
    run(sched, runner)
    assert request.output_token_ids == reference(list(range(50)), 2)


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    sched, runner = setup(max_num_batched_tokens=8)
    sched.add_request(make("a", [1, 2, 3], max_new_tokens=10))
    step(sched, runner)
    sched.add_request(make("b", list(range(20)), max_new_tokens=1))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [c.request_id for c in out.scheduled_cached_requests] == ["a"]
    assert [n.request_id for n in out.scheduled_new_requests] == ["b"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}


def test_a_long_prompt_is_prefilled_whole_in_a_step_of_its_own() -> None:
    """Sparse prefill needs a whole prompt in one step: past `whole_prompt_tokens` a prompt is not
    chunked; the running requests wait that one step, then everyone goes on."""
    sched, runner = setup(max_num_batched_tokens=8, whole_prompt_tokens=20)
    a = make("a", [1, 2, 3], max_new_tokens=6)
    sched.add_request(a)
    step(sched, runner)
    long, short = (
        make("long", list(range(100, 130)), max_new_tokens=3),
        make("short", [5, 6], max_new_tokens=2),
    )
    sched.add_request(long)
    sched.add_request(short)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"long": 30}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "long": 1, "short": 2}
    run(sched, runner)
    assert a.output_token_ids == reference([1, 2, 3], 6) and long.output_token_ids == reference(
        list(range(100, 130)), 3
    )
    assert short.output_token_ids == reference([5, 6], 2)


def test_a_prompt_under_the_whole_prompt_length_is_chunked() -> None:
    sched, runner = setup(max_num_batched_tokens=8, whole_prompt_tokens=20)
    request = make("a", list(range(19)), max_new_tokens=1)
    sched.add_request(request)
    assert [out.num_scheduled_tokens["a"] for out in run(sched, runner)] == [8, 8, 3]


def test_a_long_prompt_waits_for_its_blocks_and_nobody_overtakes_it() -> None:
    sched, runner = setup(num_blocks=9, max_num_batched_tokens=8, whole_prompt_tokens=20)
    running = make("r", list(range(12)), max_new_tokens=4)  # 3 blocks, then a 4th
    sched.add_request(running)
    for _ in range(2):
        step(sched, runner)
    long, small = make("long", list(range(200, 228)), max_new_tokens=2), make("small", [7], max_new_tokens=2)
    sched.add_request(long)  # 7 blocks: free only once "r" has finished
    sched.add_request(small)
    scheduled = [dict(out.num_scheduled_tokens) for out in run(sched, runner)]
    first_long = scheduled.index({"long": 28})
    assert first_long > 0 and all(step == {"r": 1} for step in scheduled[:first_long])
    assert running.is_finished and scheduled[first_long + 1] == {"long": 1, "small": 1}
    assert long.output_token_ids == reference(list(range(200, 228)), 2)


def test_a_prefix_hit_that_leaves_a_whole_prompt_is_not_used() -> None:
    """Sparse prefill attends over the step's own keys: a long remainder after a cached prefix is
    computed whole, prefix and all (and its lookup counts no hit); a short remainder uses the hit."""
    sched, runner = setup(max_num_batched_tokens=8, whole_prompt_tokens=20)
    document = list(range(300, 332))
    sched.add_request(make("first", document, max_new_tokens=1))
    run(sched, runner)
    hits = sched.stats().prefix_cache_hits
    long = make("long", document[:8] + list(range(400, 420)), max_new_tokens=1)  # 8 cached, 20 to go
    sched.add_request(long)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"long": 28} and out.scheduled_new_requests[0].num_computed_tokens == 0
    assert long.num_cached_tokens == 0 and sched.stats().prefix_cache_hits == hits
    run(sched, runner)
    follow_up = make("follow-up", document + [1, 2, 3], max_new_tokens=1)  # 32 cached, 3 to go
    sched.add_request(follow_up)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"follow-up": 3} and follow_up.num_cached_tokens == 32


def test_a_long_prompt_with_prompt_logprobs_is_chunked() -> None:
    """Prompt log-probabilities keep a logits row per prompt token: a whole step would hold them all."""
    sched, runner = setup(max_num_batched_tokens=8, whole_prompt_tokens=20)
    sched.add_request(make("a", list(range(24)), max_new_tokens=1, prompt_logprobs=1))
    assert [out.num_scheduled_tokens["a"] for out in run(sched, runner)] == [8, 8, 8]


def test_many_requests_joining_at_different_steps_match_reference() -> None:
    sched, runner = setup(max_num_batched_tokens=16, max_num_seqs=4, num_blocks=128)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for i in range(12)}
    lengths = {rid: rng.randrange(1, 12) for rid in prompts}
    arrivals: dict[int, list[Request]] = {}
    for i, (rid, prompt) in enumerate(prompts.items()):
        arrivals.setdefault(i * 2 // 3, []).append(make(rid, prompt, lengths[rid]))
    requests = [r for rs in arrivals.values() for r in rs]
    outputs = run(sched, runner, arrivals)
    assert max(len(o.num_scheduled_tokens) for o in outputs) == 4
    for request in requests:
        assert request.output_token_ids == reference(prompts[request.request_id], lengths[request.request_id])
    assert sched.block_manager.num_free_blocks == 128


def test_fcfs_the_head_of_the_queue_is_never_overtaken() -> None:
    sched, runner = setup(num_blocks=6)
    sched.add_request(make("r", list(range(12)), max_new_tokens=8))
    step(sched, runner)  # r owns 3 of 6 blocks, and needs a 4th for its next token
    sched.add_request(make("big", list(range(100, 116))))  # 4 blocks: does not fit yet
    sched.add_request(make("small", [7]))  # would fit, but must wait behind "big"
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["r"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    # Only a scheduled request's wait in the queue has ended.
    assert sched.get_request("r").first_scheduled_time is not None
    assert [r.first_scheduled_time for r in sched.waiting] == [None, None]


def test_max_num_seqs_limits_admission() -> None:
    sched, runner = setup(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make(rid, [1, 2], max_new_tokens=3 if rid == "a" else 5))
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["a", "b"] and sched.num_waiting == 1
    for _ in range(2):
        step(sched, runner)
    out, _ = step(sched, runner)  # a finished last step: c takes its place
    assert list(out.num_scheduled_tokens) == ["b", "c"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_recompute_when_blocks_run_out(prefix_caching: bool) -> None:
    sched, runner = setup(num_blocks=6, enable_prefix_caching=prefix_caching)
    prompts = {rid: [ord(rid) * 10 + i for i in range(8)] for rid in "abc"}
    requests = [make(rid, prompt, max_new_tokens=10) for rid, prompt in prompts.items()]
    for request in requests:
        sched.add_request(request)
    step(sched, runner)  # each holds 2 full blocks: the pool is full
    late = make("d", [1, 2, 3], max_new_tokens=10)
    prompts["d"] = [1, 2, 3]
    requests.append(late)
    sched.add_request(late)
    out, _ = step(sched, runner)  # all need a third block: c, the newest, makes room for a and b
    assert out.preempted_request_ids == {"c"} and "c" in out.finished_request_ids
    assert list(out.num_scheduled_tokens) == ["a", "b"] and not out.scheduled_new_requests
    c = requests[2]
    # c goes back in front of d, which arrived later.
    assert [r.request_id for r in sched.waiting] == ["c", "d"] and c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1 and c.num_output_tokens == 1
    assert sched.num_preemptions == 1 and sched.stats().num_preemptions == 1
    first_scheduled = c.first_scheduled_time
    assert first_scheduled is not None and late.first_scheduled_time is None
    resumed = None
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        resumed = resumed or next((n for n in out.scheduled_new_requests if n.request_id == "c"), None)
    # c resumes in full: prompt plus the token it had already produced.
    assert resumed is not None and resumed.token_ids == prompts["c"] + c.output_token_ids[:1]
    assert resumed.num_prompt_tokens == 8 and c.num_cached_tokens == 0
    assert c.first_scheduled_time == first_scheduled, "resuming after preemption is not a first schedule"
    assert late.first_scheduled_time is not None and late.first_scheduled_time >= late.arrival_time
    for request in requests:
        assert request.output_token_ids == reference(prompts[request.request_id], 10)
        assert request.finish_reason == FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == 6


def test_a_request_that_is_itself_the_newest_preempts_itself() -> None:
    sched, runner = setup(num_blocks=4)
    b = make("b", list(range(20, 28)), max_new_tokens=2)
    sched.add_request(make("a", list(range(6)), max_new_tokens=2))
    sched.add_request(b)
    step(sched, runner)
    out, _ = step(sched, runner)  # a still fits its 2 blocks; b needs a third and is the newest
    assert out.preempted_request_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    assert not out.scheduled_new_requests  # nobody is admitted in a step that had to preempt
    out, _ = step(sched, runner)  # a finished last step: b resumes, and its freed blocks were still cached
    resumed = out.scheduled_new_requests[0]
    assert resumed.request_id == "b" and resumed.num_computed_tokens == 8 and len(resumed.token_ids) == 9
    assert b.num_cached_tokens == 0  # what the first admission found, not the resume
    run(sched, runner)
    assert b.output_token_ids == reference(list(range(20, 28)), 2)
    assert sched.block_manager.num_free_blocks == 4


def test_nobody_is_admitted_in_a_step_that_preempted() -> None:
    sched, runner = setup(num_blocks=6, max_num_batched_tokens=8)
    sched.add_request(make("a", list(range(8)), max_new_tokens=8))
    step(sched, runner)
    sched.add_request(make("b", list(range(20, 40)), max_new_tokens=2))
    step(sched, runner)  # a: 3 blocks, b: first chunk of 7 tokens in 2 blocks
    out, _ = step(sched, runner)  # b's next chunk needs 2 more blocks, 1 is free: b preempts itself
    assert out.preempted_request_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    # b's own chunk would fit again now, but the step that just evicted it does not take it back.
    assert not out.scheduled_new_requests
    run(sched, runner)
    assert sched.block_manager.num_free_blocks == 6


def test_a_request_stops_at_the_pool_size_instead_of_preempting_itself_forever() -> None:
    sched, runner = setup(num_blocks=3)
    request = make("a", list(range(10)), max_new_tokens=50)
    sched.add_request(request)
    run(sched, runner)
    assert request.num_tokens == 12 and request.finish_reason == FinishReason.LENGTH
    assert sched.num_preemptions == 0


def test_prefix_cache_hits_for_a_repeated_prefix() -> None:
    sched, runner = setup()
    prompt = list(range(100, 116))
    first = make("a", prompt, max_new_tokens=2)
    sched.add_request(first)
    run(sched, runner)
    assert first.num_cached_tokens == 0
    second = make("b", prompt[:12] + [1, 2, 3])
    sched.add_request(second)
    out, _ = step(sched, runner)
    assert out.scheduled_new_requests[0].num_computed_tokens == 12 and out.num_scheduled_tokens == {"b": 3}
    assert second.num_cached_tokens == 12
    # The whole prompt is cached: the last block is recomputed anyway, to get logits for it.
    third = make("c", prompt)
    sched.add_request(third)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": 1, "c": 4} and third.num_cached_tokens == 12
    run(sched, runner)
    assert second.output_token_ids == reference(prompt[:12] + [1, 2, 3], 4)
    assert third.output_token_ids == reference(prompt, 4)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16 + 15 + 16, 24)


def test_two_running_requests_share_cached_blocks() -> None:
    sched, runner = setup(num_blocks=8)
    prompt = list(range(12))
    a, b = make("a", prompt, max_new_tokens=6), make("b", prompt + [50], max_new_tokens=6)
    sched.add_request(a)
    step(sched, runner)
    sched.add_request(b)
    step(sched, runner)
    bm = sched.block_manager
    assert bm.get_block_ids("b")[:3] == bm.get_block_ids("a")[:3] and b.num_cached_tokens == 12
    sched.abort_requests(["a"])
    assert len(bm.get_block_ids("b")) == 4 and bm.num_free_blocks == 4  # shared blocks stay with b
    run(sched, runner)
    assert b.output_token_ids == reference(prompt + [50], 6) and bm.num_free_blocks == 8


def test_cached_blocks_are_evicted_when_free_blocks_run_out() -> None:
    sched, runner = setup(num_blocks=6)
    prompt = list(range(8))
    sched.add_request(make("a", prompt, max_new_tokens=1))
    run(sched, runner)
    sched.add_request(make("big", list(range(100, 122)), max_new_tokens=1))  # needs all 6 blocks
    run(sched, runner)
    again = make("c", prompt, max_new_tokens=1)
    sched.add_request(again)
    run(sched, runner)
    assert again.num_cached_tokens == 0 and again.output_token_ids == reference(prompt, 1)


def test_aborts_of_waiting_and_running_requests_free_everything() -> None:
    sched, runner = setup(num_blocks=8, max_num_batched_tokens=8)
    for rid, n in [("run", 6), ("chunk", 20), ("wait", 4)]:
        sched.add_request(make(rid, list(range(n)), max_new_tokens=20))
    out = sched.schedule()  # run: 6 tokens, chunk: first 2 tokens; wait: no budget left
    assert list(out.num_scheduled_tokens) == ["run", "chunk"]
    sched.abort_requests(["run", "wait", "unknown"])
    sampled = runner.execute(out)
    assert [r.request_id for r in sched.update_from_output(out, sampled)] == []  # run was aborted mid-step
    chunk = sched.get_request("chunk")
    sched.abort_requests({"chunk"})
    assert chunk.finish_reason == FinishReason.ABORT and chunk.status == RequestStatus.FINISHED
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_request_ids == {"run", "chunk", "wait"} and out.is_empty


def test_finish_request_with_a_reason() -> None:
    sched, runner = setup()
    request = make("a", [1, 2, 3], max_new_tokens=10)
    sched.add_request(request)
    step(sched, runner)
    sched.finish_request("a", FinishReason.STOP_SEQUENCE)
    sched.finish_request("a", FinishReason.ABORT)  # already gone: ignored
    assert request.finish_reason == FinishReason.STOP_SEQUENCE and sched.block_manager.num_free_blocks == 64


def scripted(tokens: list[int]) -> Model:
    it = iter(tokens)
    return lambda context: next(it)


@pytest.mark.parametrize(
    ("params", "config", "expected_tokens", "reason"),
    [
        ({"eos": frozenset({2})}, {}, [5, 2], FinishReason.EOS_TOKEN),
        ({"eos": frozenset({2}), "ignore_eos": True}, {}, [5, 2, 6, 7], FinishReason.LENGTH),
        ({"stop_token_ids": (6,)}, {}, [5, 2, 6], FinishReason.STOP_SEQUENCE),
        ({}, {}, [5, 2, 6, 7], FinishReason.LENGTH),
        ({}, {"max_model_len": 6}, [5, 2, 6], FinishReason.LENGTH),
        ({"eos": frozenset({7})}, {}, [5, 2, 6, 7], FinishReason.EOS_TOKEN),  # eos beats length
    ],
)
def test_stop_conditions(
    params: dict, config: dict, expected_tokens: list[int], reason: FinishReason
) -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, **config))
    runner = FakeRunner(sched, scripted([5, 2, 6, 7, 8, 9]))
    request = make("a", [1, 1, 1], max_new_tokens=4, **params)
    sched.add_request(request)
    run(sched, runner)
    assert request.output_token_ids == expected_tokens and request.finish_reason == reason


def test_stats_and_validation() -> None:
    sched, runner = setup(num_blocks=4)
    assert sched.max_tokens_in_pool == 16
    with pytest.raises(ValueError):
        sched.add_request(make("long", list(range(17))))
    sched.add_request(make("a", list(range(5))))
    sched.add_request(make("b", list(range(5))))
    with pytest.raises(ValueError):
        sched.add_request(make("a", [1]))
    assert (sched.num_waiting, sched.num_running) == (2, 0)
    step(sched, runner)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.step_num_tokens, stats.step_num_seqs) == (2, 0, 10, 2)
    assert (stats.num_free_blocks, stats.num_total_blocks, stats.kv_cache_usage) == (0, 4, 1.0)


def test_a_missing_sample_is_an_error() -> None:
    sched, _ = setup()
    sched.add_request(make("a", [1, 2]))
    with pytest.raises(ValueError, match="nothing was sampled"):
        sched.update_from_output(sched.schedule(), {})


@dataclass
class RandomLoad:
    expected: dict[str, list[int]]  # each request's tokens generated alone (up to its stop token)
    requests: list[Request]
    aborted: set[str]


def drive_random_load(
    sched: Scheduler,
    step_once: Callable[[], object],
    seed: int,
    rounds: int,
    admit_until: int,
    stop_tokens: frozenset[int] = frozenset(),
) -> RandomLoad:
    """Requests over three shared prefixes arrive at random in the first `admit_until` rounds (half
    of them stopping on `stop_tokens`, if any), a few running ones are aborted, one step a round."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    load = RandomLoad({}, [], set())
    for i in range(rounds):
        if i < admit_until and rng.random() < 0.7:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            eos = stop_tokens if stop_tokens and rng.random() < 0.5 else frozenset()
            request = make(f"r{i}", prompt, max_new_tokens=rng.randrange(1, 24), eos=eos)
            tokens = reference(prompt, request.sampling_params.max_new_tokens)
            stop = next((j for j, t in enumerate(tokens) if t in eos), len(tokens) - 1)
            load.expected[request.request_id] = tokens[: stop + 1]
            load.requests.append(request)
            sched.add_request(request)
        if sched.running and rng.random() < 0.05:
            victim = rng.choice(sched.running).request_id
            load.aborted.add(victim)
            sched.abort_requests([victim])
        step_once()
    return load


@pytest.mark.parametrize("whole_prompt_tokens", [None, 12])
def test_random_load_with_shared_prefixes_preemptions_and_aborts(whole_prompt_tokens: int | None) -> None:
    sched, runner = setup(
        num_blocks=16, max_num_batched_tokens=20, max_num_seqs=6, whole_prompt_tokens=whole_prompt_tokens
    )
    steps: list[SchedulerOutput] = []
    load = drive_random_load(
        sched, lambda: steps.append(step(sched, runner)[0]), seed=1, rounds=60, admit_until=40
    )
    expected, requests, aborted = load.expected, load.requests, load.aborted
    steps += run(sched, runner)
    assert sched.num_preemptions > 0 and sched.block_manager.prefix_cache_hits > 0 and aborted
    longest_step = max(out.total_num_scheduled_tokens for out in steps)
    assert (
        longest_step > 20 if whole_prompt_tokens else longest_step <= 20
    )  # whole prompts ran past the budget
    for request in requests:
        if request.request_id not in aborted:
            assert request.output_token_ids == expected[request.request_id]
    assert sched.block_manager.num_free_blocks == 16


def test_step_kinds() -> None:
    assert step_kind(new_requests=1, num_tokens=1, num_seqs=1) == "prefill"  # a one-token prompt
    assert step_kind(new_requests=0, num_tokens=40, num_seqs=3) == "prefill"  # a prompt's next chunk
    assert step_kind(new_requests=0, num_tokens=3, num_seqs=3) == "decode"


def test_a_request_outgrowing_the_pool_spills_to_host_and_keeps_its_kv() -> None:
    """The long-context tier: a request of 13 blocks against a pool of 6 moves its cold blocks to
    the host tier instead of preempting itself; every context it is sampled from still holds its
    tokens (read from host where spilled), and its answer is the reference's."""
    sched, runner = setup(num_blocks=6, max_num_batched_tokens=8, num_host_blocks=20, spill_keep=(1, 2))
    sched.grow_host_tier(20)  # the engine does this as host memory is allocated
    long = make("long", list(range(40)), max_new_tokens=12)
    sched.add_request(long)
    run(sched, runner)
    stats = sched.stats()
    assert long.output_token_ids == reference(list(range(40)), 12)
    assert stats.num_preemptions == 0 and stats.host_spilled_blocks >= 13 - 6
    assert sched.block_manager.num_free_blocks == 6 and sched.block_manager.host_tier.num_held_blocks == 0


def test_whole_prompts_longer_than_the_pool_are_chunked_and_spill() -> None:
    sched, runner = setup(num_blocks=6, max_num_batched_tokens=8, whole_prompt_tokens=20, num_host_blocks=20,
                          spill_keep=(1, 2))  # fmt: skip
    sched.grow_host_tier(20)
    long = make("long", list(range(30)), max_new_tokens=3)  # over the whole-prompt length, over the pool
    sched.add_request(long)
    assert [out.num_scheduled_tokens["long"] for out in run(sched, runner)] == [8, 8, 8, 6, 1, 1]
    assert long.output_token_ids == reference(list(range(30)), 3)


def test_a_whole_prompt_spills_a_running_context_to_fit_beside_it() -> None:
    """Two long contexts that together outgrow the pool, the second a whole prompt: rather than
    wait for the first to finish, it runs once the first's cold blocks spill to the host tier; as
    they grow, they spill rather than preempt each other, and both answers are the reference's."""
    sched, runner = setup(num_blocks=9, max_num_batched_tokens=24, whole_prompt_tokens=20, num_host_blocks=20,
                          spill_keep=(1, 2), spill_min_context=16)  # fmt: skip
    sched.grow_host_tier(20)
    first, second = make("first", list(range(24)), max_new_tokens=6), make("second", list(range(50, 74)), 6)
    outputs = run(sched, runner, {0: [first], 2: [second]})
    assert outputs[2].num_scheduled_tokens == {"second": 24}  # whole, one step after it arrived
    assert sched.stats().host_spilled_blocks >= 6 + 1 - 3 and sched.stats().num_preemptions == 0
    assert first.output_token_ids == reference(list(range(24)), 6)
    assert second.output_token_ids == reference(list(range(50, 74)), 6)
    assert sched.block_manager.num_free_blocks == 9 and sched.block_manager.host_tier.num_held_blocks == 0


def test_a_lone_context_whose_chunks_outgrow_the_pool_takes_shorter_ones() -> None:
    """A prompt chunk (the budget, 40 tokens) longer than the pool (24 tokens): the request alone
    takes chunks the free and spillable blocks hold, rather than wait or preempt itself for ever."""
    sched, runner = setup(num_blocks=6, max_num_batched_tokens=40, num_host_blocks=20, spill_keep=(1, 2))
    sched.grow_host_tier(20)
    long = make("long", list(range(50)), max_new_tokens=4)
    sched.add_request(long)
    chunks = [out.num_scheduled_tokens["long"] for out in run(sched, runner)]
    assert chunks[0] == 24 and sum(chunks[:-3]) == 50 and max(chunks) < 40
    assert long.output_token_ids == reference(list(range(50)), 4) and sched.stats().num_preemptions == 0
    assert sched.block_manager.num_free_blocks == 6 and sched.block_manager.host_tier.num_held_blocks == 0


def test_a_deferred_step_computes_its_position_again() -> None:
    """A step that gave a request no token (its grammar's mask was late): the request keeps its
    tokens, and the next step computes the same position again and samples from it."""
    sched, _ = setup()
    request = make("a", list(range(6)), max_new_tokens=3)
    other = make("b", list(range(10, 13)), max_new_tokens=3)
    sched.add_request(request)
    sched.add_request(other)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6, "b": 3}
    sched.update_from_output(out, {"b": 7}, deferred={"a"})
    assert (request.num_computed_tokens, request.num_output_placeholders, request.output_token_ids) == (
        5,
        0,
        [],
    )
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert {c.request_id: c.num_computed_tokens for c in out.scheduled_cached_requests}["a"] == 5
    sched.update_from_output(out, {"a": 4, "b": 8})
    assert request.output_token_ids == [4] and other.output_token_ids == [7, 8]
    assert sched.stats().num_deferred_steps == 1  # tgserve_guided_deferred_steps
