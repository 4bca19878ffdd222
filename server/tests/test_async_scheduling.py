"""Async scheduling: step N+1 is scheduled before step N's sampled tokens reach the scheduler.

The fake runner of the scheduler tests computes each step at once; here its tokens are handed to
`update_from_output` one step late, as the engine does when it overlaps the host with the GPU. The
outputs must equal each request generated alone, with the same stop rules, preemption, aborts and
prefix caching as the synchronous loop.
"""

from __future__ import annotations

from tgserve.server.core.request import FinishReason, Request
from tgserve.server.core.scheduler import Scheduler
from tgserve.server.core.scheduler_output import SchedulerOutput

from .test_scheduler import (
    FakeRunner,
    check_invariants,
    drive_random_load,
    make,
    next_token,
    reference,
    setup,
)


class LaggingLoop:
    """Schedules step N+1, then applies step N's tokens: the engine's async order."""

    def __init__(self, sched: Scheduler, runner: FakeRunner) -> None:
        self.sched, self.runner = sched, runner
        self.in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None
        self.scheduled: list[SchedulerOutput] = []

    def step(self) -> list[Request]:
        out = self.sched.schedule()
        check_invariants(self.sched, out)
        self.scheduled.append(out)
        previous, self.in_flight = self.in_flight, (out, self.runner.execute(out))
        return self.sched.update_from_output(*previous) if previous else []

    def run(self) -> None:
        for _ in range(10_000):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("did not finish")


def scheduled_steps(loop: LaggingLoop, request_id: str) -> int:
    return sum(request_id in out.num_scheduled_tokens for out in loop.scheduled)


def test_length_limited_requests_take_no_extra_step() -> None:
    sched, runner = setup()
    requests = [make(f"r{n}", list(range(3 + n)), max_new_tokens=n) for n in (1, 2, 5)]
    for request in requests:
        sched.add_request(request)
    loop = LaggingLoop(sched, runner)
    loop.run()
    for request in requests:
        n = request.sampling_params.max_new_tokens
        assert request.output_token_ids == reference(request.prompt_token_ids, n)
        assert request.finish_reason == FinishReason.LENGTH
        # One prefill step, then one step per further token: nothing computed past the limit.
        assert scheduled_steps(loop, request.request_id) == n
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_a_stop_token_learnt_late_costs_one_dropped_step() -> None:
    sched, runner = setup()
    prompt = list(range(6))
    full = reference(prompt, 8)
    request = make("a", prompt, max_new_tokens=8, eos=frozenset({full[2]}))
    sched.add_request(request)
    loop = LaggingLoop(sched, runner)
    loop.run()
    assert request.output_token_ids == full[:3] and request.finish_reason == FinishReason.EOS_TOKEN
    # Tokens 1-3 were sampled by steps 1-3; step 4 was scheduled before token 3 was known.
    assert scheduled_steps(loop, "a") == 4
    loop.step()  # the dropped step's output arrives for a finished request: ignored
    assert request.output_token_ids == full[:3]


def test_random_load_with_stops_preemptions_and_aborts_matches_requests_alone() -> None:
    sched, runner = setup(num_blocks=16, max_num_batched_tokens=20, max_num_seqs=6)
    loop = LaggingLoop(sched, runner)
    stop_tokens = frozenset(range(10, 40))  # about 6% of next_token's outputs
    load = drive_random_load(sched, loop.step, seed=7, rounds=80, admit_until=50, stop_tokens=stop_tokens)
    expected, requests, aborted = load.expected, load.requests, load.aborted
    loop.run()
    assert sched.num_preemptions > 0 and sched.block_manager.prefix_cache_hits > 0 and aborted
    assert any(r.finish_reason == FinishReason.EOS_TOKEN for r in requests)
    for request in requests:
        if request.request_id not in aborted:
            assert request.output_token_ids == expected[request.request_id], request.request_id
    assert sched.block_manager.num_free_blocks == 16


def test_a_request_preempted_with_a_token_in_flight_keeps_it() -> None:
    # Two requests that outgrow a 4-block pool: the newer one is preempted while its token is
    # being sampled, gets that token, and resumes with it once the older one has finished.
    sched, runner = setup(num_blocks=4, max_num_batched_tokens=16)
    a, b = make("a", [1, 2, 3, 4, 5, 6], max_new_tokens=8), make("b", [7, 8, 9, 10, 11], max_new_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    LaggingLoop(sched, runner).run()
    assert sched.num_preemptions > 0
    assert a.output_token_ids == reference(a.prompt_token_ids, 8)
    assert b.output_token_ids == reference(b.prompt_token_ids, 8)
    assert next_token(b.all_token_ids[:-1]) == b.output_token_ids[-1]


def test_a_request_finishing_on_its_token_in_flight_is_never_a_preemption_victim() -> None:
    # b (the newest) will finish on the token being sampled while a needs a fourth block of a
    # three-block pool: b's blocks go to a; preempting b instead would free nothing more, count a
    # preemption and stall admission for the step.
    sched, runner = setup(num_blocks=3, max_num_batched_tokens=16)
    a, b = make("a", [1, 2, 3], max_new_tokens=8), make("b", [50, 51, 52, 53, 54], max_new_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    LaggingLoop(sched, runner).run()
    assert sched.num_preemptions == 0 and b.num_preemptions == 0
    assert a.output_token_ids == reference(a.prompt_token_ids, 8)
    assert b.output_token_ids == reference(b.prompt_token_ids, 2)
    assert sched.block_manager.num_free_blocks == 3


def test_a_deferred_step_holds_its_request_until_the_step_after_it_is_back() -> None:
    """Async: step N+1 was scheduled reading the token step N deferred, so it is deferred too; the
    request is not scheduled while it is in flight, then resumes from its last known token."""
    sched, _ = setup()
    request = make("a", list(range(6)), max_new_tokens=3)
    other = make("b", list(range(10, 13)), max_new_tokens=6)
    sched.add_request(request)
    sched.add_request(other)
    first = sched.schedule()
    second = sched.schedule()  # both decode the tokens step 1 is still sampling
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    sched.update_from_output(first, {"b": 7}, deferred={"a"})
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"b": 1}  # "a" is held: step 2 read a token that never came
    sched.update_from_output(second, {"b": 8}, deferred={"a"})
    assert (request.num_computed_tokens, request.num_output_placeholders) == (5, 0)
    fourth = sched.schedule()
    assert fourth.num_scheduled_tokens == {"a": 1, "b": 1}
    assert {c.request_id: c.num_computed_tokens for c in fourth.scheduled_cached_requests}["a"] == 5
    sched.update_from_output(third, {"b": 9})
    sched.update_from_output(fourth, {"a": 4, "b": 5})
    assert request.output_token_ids == [4] and other.output_token_ids == [7, 8, 9, 5]


def test_a_guided_request_keeps_its_blocks_while_its_last_token_may_be_deferred() -> None:
    """Async: a request's token in flight would end it (max_new_tokens); an unguided one gives its
    blocks back at once, a guided one keeps them, since its token may come back deferred."""
    from tgserve.server.protocol.params import GuidedDecoding

    sched, _ = setup()
    guided = make("g", list(range(6)), max_new_tokens=1, guided=GuidedDecoding("regex", "[a-z]+"))
    plain = make("p", list(range(10, 16)), max_new_tokens=1)
    sched.add_request(guided)
    sched.add_request(plain)
    first = sched.schedule()
    blocks = sched.block_manager.get_block_ids("g")
    second = sched.schedule()  # both wait for their last token
    assert second.num_scheduled_tokens == {}
    assert sched.block_manager.get_block_ids("g") == blocks and sched.block_manager.get_block_ids("p") == []
    sched.update_from_output(first, {"p": 3}, deferred={"g"})
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"g": 1} and sched.block_manager.get_block_ids("g") == blocks
    sched.update_from_output(second, {})
    sched.update_from_output(third, {"g": 4})
    assert guided.output_token_ids == [4] and guided.is_finished
