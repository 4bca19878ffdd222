"""The scheduler: one rule, every request's num_computed_tokens catches up with its num_tokens.

Each step hands out a token budget: running requests first, in the order they were admitted (a
decoding request gets one token, a prompt still being prefilled gets the next chunk), then waiting
requests first come, first served. One exception: with `whole_prompt_tokens` set (sparse prefill on
CUDA), a prompt that long at the head of the queue is prefilled whole, past the budget, in a step
of its own. When blocks run out the newest running request is preempted:
its blocks are freed and it is recomputed later. Plain Python; the model runner sees only the
`SchedulerOutput`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping

from tgserve.server.config.scheduler import SchedulerConfig
from tgserve.server.core.block_manager import BlockManager, PrefixHit
from tgserve.server.core.host_tier import HostTier
from tgserve.server.core.request import FinishReason, Request, RequestStatus
from tgserve.server.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tgserve.server.protocol.outputs import EngineStats


class _StepPlan:
    """The output of one `schedule()` call while it is being built."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.new: list[NewRequestData] = []
        self.cached: list[CachedRequestData] = []
        self.num_scheduled: dict[str, int] = {}
        self.sampling: set[str] = set()
        self.preempted: set[str] = set()

    def add(self, request: Request, num_tokens: int) -> None:
        """Schedule `num_tokens` of `request` and count them as computed from now on."""
        self.num_scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
            # Its last token is computed this step: one more token is on its way.
            request.num_output_placeholders += 1
            self.sampling.add(request.request_id)


class Scheduler:
    """Decides, step by step, which requests compute how many tokens, and tracks their lifecycle.

    Usage per engine step: `schedule()`, run the model on the output, then
    `update_from_output(output, sampled_token_ids)`. Requests enter with `add_request` and leave by
    finishing (stop conditions), `abort_requests` or `finish_request`; finished ids reach the
    runner in the next `SchedulerOutput.finished_request_ids`.

    Scheduled tokens count as computed as soon as they are scheduled, and a token being sampled
    counts as a placeholder until its step's output arrives. So the next step can be scheduled
    before the last one's tokens are known (async scheduling: the host plans step N+1 while the GPU
    runs step N); a request whose pending tokens may finish it is not scheduled further, and the
    one wasted step of a request that stops on a token it did not know yet is dropped in
    `update_from_output`.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | None = None) -> None:
        self.config = config
        # Its host memory may still be being allocated: the engine adds blocks as they are ready.
        host_tier = HostTier(config.num_host_blocks, ready=0) if config.num_host_blocks else None
        self.block_manager = block_manager or BlockManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            host_tier,
            config.spill_keep,
            config.first_host_block_id,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self._requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()  # to report in the next SchedulerOutput
        self._num_preemptions = 0
        self._num_deferred_steps = 0
        self._last_step_tokens = 0
        self._last_step_seqs = 0
        # A request can never hold more tokens than the pool, whatever max_model_len says; stopping
        # there (LENGTH) keeps a lone request from preempting itself forever.
        self._max_len = min(config.max_model_len, self.block_manager.max_tokens_in_pool)

    # ---- requests in and out -------------------------------------------------------------------

    @property
    def max_tokens_in_pool(self) -> int:
        """The longest prompt that can ever be scheduled; the caller rejects longer ones."""
        return self.block_manager.max_tokens_in_pool

    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS). Raises ValueError for a duplicate id or an impossible prompt."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.max_tokens_in_pool:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens but the KV cache holds "
                f"at most {self.max_tokens_in_pool}"
            )
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str] | set[str] | tuple[str, ...]) -> None:
        """Finish waiting or running requests with FinishReason.ABORT; unknown ids are ignored."""
        for request_id in request_ids:
            self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """Finish a request from outside (abort, stop string): free its blocks, report it next step."""
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, reason)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None (finished requests are forgotten)."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """True when finished ids are waiting to be reported to the runner by the next `schedule()`."""
        return bool(self._finished_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start."""
        return self._num_preemptions

    def grow_host_tier(self, ready_blocks: int) -> None:
        """The host tier's memory now has `ready_blocks` blocks allocated (`HostKVPool.ready_blocks`)."""
        if self.block_manager.host_tier is not None:
            self.block_manager.host_tier.grow(ready_blocks)

    def reset_counters(self) -> None:
        """Zero the counters since start (preemptions, deferred steps, prefix cache lookups): after
        the engine's own warm-up requests, so that metrics count only what clients asked."""
        self._num_preemptions = 0
        self._num_deferred_steps = 0
        self.block_manager.reset_counters()

    def stats(self) -> EngineStats:
        """A snapshot for metrics."""
        bm = self.block_manager
        return EngineStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            **_host_tier_stats(bm),
            num_deferred_steps=self._num_deferred_steps,
            step_num_tokens=self._last_step_tokens,
            step_num_seqs=self._last_step_seqs,
        )

    # ---- one step --------------------------------------------------------------------------------

    def schedule(self, hold: Collection[str] = ()) -> SchedulerOutput:
        """Plan the next step; its tokens count as computed from here on (the output's request data
        carry the counts from before the step, where the runner starts). Running requests in
        `hold` sit this step out (a deferred one whose grammar's mask is still being computed)."""
        plan = _StepPlan(self.config.max_num_batched_tokens)
        if not self._schedule_whole_prompt(plan):
            self._schedule_running(plan, hold)
            # After a preemption the pool is known to be short: admitting newcomers would only get
            # them (or the requests just preempted) preempted again.
            if not plan.preempted:
                self._schedule_waiting(plan)
        for cached in plan.cached:  # spilled at any point of the step (to make room for others too)
            cached.moved_blocks.extend(self.block_manager.take_moved(cached.request_id))
        finished = self._finished_ids | plan.preempted
        self._finished_ids = set()
        total = sum(plan.num_scheduled.values())
        self._last_step_tokens, self._last_step_seqs = total, len(plan.num_scheduled)
        return SchedulerOutput(
            scheduled_new_requests=plan.new,
            scheduled_cached_requests=plan.cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_request_ids=finished,
            preempted_request_ids=plan.preempted,
            sampling_request_ids=frozenset(plan.sampling),
            kv_transfers=self.block_manager.take_kv_transfers(),
        )

    def _schedule_running(self, plan: _StepPlan, hold: Collection[str] = ()) -> None:
        # Requests whose tokens in flight finish them compute nothing more: their blocks serve the
        # others from this step on (the step still writing them runs before any step that reuses
        # them), before anyone is preempted for want of blocks.
        for request in self.running:
            # A guided request's token may yet be deferred (its grammar's mask late): it keeps its
            # blocks, and computes its position again if so.
            if self._may_finish_on_pending(request) and request.sampling_params.guided is None:
                self.block_manager.free(request)
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            i += 1
            if (
                self._may_finish_on_pending(request)
                or self._held_for_deferred(request)
                or request.request_id in hold
            ):
                continue
            num_new = min(
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                plan.budget,
            )
            allocated = self._allocate_or_preempt(request, num_new, plan)
            if allocated is None:
                break  # it preempted itself: it was the newest, nothing runs after it
            new_blocks, num_new = allocated
            plan.cached.append(CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens))
            plan.add(request, num_new)

    @staticmethod
    def _held_for_deferred(request: Request) -> bool:
        """A step deferred its token: it waits until no step of its is in flight (`defer`)."""
        if request.held_for_deferred and not request.num_output_placeholders:
            request.held_for_deferred = False
        return request.held_for_deferred

    def _may_finish_on_pending(self, request: Request) -> bool:
        """Its tokens in flight reach max_new_tokens or the length limit: another step would be waste."""
        pending = request.num_output_placeholders
        return pending > 0 and (
            request.num_output_tokens + pending >= request.sampling_params.max_new_tokens
            or request.num_tokens + pending >= self._max_len
        )

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: _StepPlan
    ) -> tuple[list[int], int] | None:
        """Blocks for `request`'s `num_new` tokens, preempting the newest running requests until
        they fit; returns them and the tokens they are for.

        A request finishing on its tokens in flight holds no blocks, so preempting it would free
        nothing: victims are the newest of the others (`request` itself at the latest). Before
        anyone is preempted, long contexts spill cold blocks to the host tier where they can; and
        rather than preempt itself, a request spills its own, or, running alone (nobody else will
        free blocks), takes a shorter prompt chunk.
        Returns None when `request` itself had to be preempted.
        """
        bm = self.block_manager
        while True:
            new_blocks = bm.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks, num_new
            owned = len(bm.get_block_ids(request.request_id))
            short = bm.num_blocks_for(request.num_computed_tokens + num_new) - owned - bm.num_free_blocks
            if self._spill_long_contexts(short, plan):
                continue
            newest = len(self.running) - 1
            while self._may_finish_on_pending(self.running[newest]):
                newest -= 1
            if self.running[newest] is request:
                if bm.spill(request, short):
                    continue
                fewer = self._fitting_chunk(request, num_new) if len(self.running) == 1 else 0
                if fewer:
                    num_new = fewer
                    continue
            victim = self.running.pop(newest)
            self._preempt(victim)
            plan.preempted.add(victim.request_id)
            if victim is request:
                return None

    def _fitting_chunk(self, request: Request, num_new: int) -> int:
        """Fewer of a request's prompt tokens than `num_new`: as many as the free blocks and its own
        spillable ones hold; 0 where that is none. (A lone context outgrowing a pool that its chunks
        alone would fill moves on a smaller chunk rather than preempt itself, again and again.)"""
        bm = self.block_manager
        spillable = len(bm.spillable_blocks(request))
        if spillable:
            spillable = min(spillable, bm.host_tier.num_holdable_blocks)
        fit = bm.num_fitting_tokens(request) + spillable * bm.block_size
        return fit if 0 < fit < num_new else 0

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and requeue it at the front: swapped out to the host tier where
        it has room (its KV comes back when it resumes), else its tokens are recomputed later."""
        if not self.block_manager.swap_out(request):
            self.block_manager.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._num_preemptions += 1
        # Victims are taken newest first, so each older one goes in front of the newer ones.
        self.waiting.appendleft(request)

    def _schedule_whole_prompt(self, plan: _StepPlan) -> bool:
        """A whole prompt at the head of the queue (`SchedulerConfig.whole_prompt_tokens`) runs
        alone in this step when the pool holds it: running requests wait for one step, as they
        would behind any long prefill. Returns whether it was scheduled."""
        whole = self.config.whole_prompt_tokens
        if whole is None or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        request = self.waiting[0]
        if request.num_tokens < whole or self.block_manager.is_swapped(request):
            return False  # not long enough whatever the cache holds (no lookup), or swapped out
        num_cached = self.block_manager.lookup_prefix(request).num_tokens
        if not self._runs_whole(request, num_cached):
            return False
        # Its cached prefix is not used: sparse prefill attends over the step's own keys only.
        bm = self.block_manager
        if not self._spill_long_contexts(bm.num_blocks_for(request.num_tokens) - bm.num_free_blocks, plan):
            return False  # it waits (FCFS) while the running requests go on and free blocks
        if bm.allocate_slots(request, request.num_tokens) is None:
            return False
        self._admit(plan, request, 0, request.num_tokens)
        return True

    def _spill_long_contexts(self, short: int, plan: _StepPlan) -> bool:
        """Whether `short` more device blocks are free, after spilling cold blocks of running long
        contexts (`SchedulerConfig.spill_min_context`, the longest first) to the host tier: long
        contexts then run together though they outgrow the pool, with nobody preempted. Of requests
        already in this step, only blocks written before it move (their moved ids reach the runner
        with the step). False, spilling nothing, when they cannot."""
        if short <= 0:
            return True
        bm, past = self.block_manager, self.config.spill_min_context
        if past is None:
            return False
        written = [r.num_computed_tokens - plan.num_scheduled.get(r.request_id, 0) for r in self.running]
        cold = sorted(
            (len(bm.spillable_blocks(r, written[i])), i)
            for i, r in enumerate(self.running)
            if written[i] > past
        )[::-1]
        if sum(count for count, _ in cold) < short or bm.host_tier.num_holdable_blocks < short:
            return False
        for count, i in cold:
            take = min(count, short)
            spilled = bm.spill(self.running[i], take, written[i])
            assert spilled, "counted as spillable above"
            short -= take
            if not short:
                break
        return True

    def _runs_whole(self, request: Request, num_cached: int) -> bool:
        """Whether a waiting request is prefilled whole: at least `whole_prompt_tokens` left after its
        cached prefix, and no prompt log-probabilities (whose logits rows a whole step would hold
        for every prompt token at once). It has no token in flight."""
        whole, bm = self.config.whole_prompt_tokens, self.block_manager
        return (
            whole is not None
            and request.num_tokens - num_cached >= whole
            # One that outgrows the pool (spilling to the host tier as it goes) is prefilled in chunks.
            and request.num_tokens <= bm.num_total_blocks * bm.block_size
            and request.sampling_params.prompt_logprobs is None
            and not request.num_output_placeholders
        )

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        bm = self.block_manager
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: it resumes once the token is known
            if bm.is_swapped(request):  # its KV comes back from the host tier
                num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
                if bm.swap_in(request, num_new) is None:
                    break
                self._admit(plan, request, request.num_computed_tokens, num_new)
                continue
            # A waiting request (new or preempted) has nothing in its own blocks; look up the cache
            # each time it is tried, since blocks may have been cached or evicted since.
            hit = bm.lookup_prefix(request)
            if self._runs_whole(request, hit.num_tokens):
                break  # it runs in a step of its own (FCFS: nobody overtakes it)
            num_new = self._allocate_waiting(
                request, min(request.num_tokens - hit.num_tokens, plan.budget), hit, plan
            )
            if not num_new:
                break  # FCFS: nobody overtakes the head of the queue
            self._admit(plan, request, hit.num_tokens, num_new, len(hit.host_blocks) * bm.block_size)

    def _allocate_waiting(self, request: Request, num_new: int, hit: PrefixHit, plan: _StepPlan) -> int:
        """Blocks for a waiting request's first `num_new` tokens past its prefix hit, spilling long
        contexts to make room where the pool is short of them; returns the tokens they are for, 0
        when none were allocated. With nothing running (nobody to free blocks), a prompt takes a
        chunk as long as the free blocks hold rather than wait for ever."""
        bm = self.block_manager
        if bm.allocate_slots(request, num_new, hit.block_ids, hit.host_blocks) is not None:
            return num_new
        short = bm.num_blocks_for(hit.num_tokens + num_new) - len(hit.block_ids) - bm.num_free_blocks
        if self._spill_long_contexts(short, plan):
            if bm.allocate_slots(request, num_new, hit.block_ids, hit.host_blocks) is not None:
                return num_new
        fit = bm.num_fitting_tokens(request, hit.block_ids, hit.host_blocks)
        if self.running or not 0 < fit < num_new:
            return 0
        return fit if bm.allocate_slots(request, fit, hit.block_ids, hit.host_blocks) is not None else 0

    def _admit(
        self, plan: _StepPlan, request: Request, num_cached: int, num_new: int, from_host: int = 0
    ) -> None:
        """Move the head of the queue, whose blocks are allocated, to running with `num_new` tokens
        (`num_cached` from the prefix cache, `from_host` of them loaded from the host tier)."""
        bm = self.block_manager
        self.waiting.popleft()
        self.running.append(request)
        request.mark_running()
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        bm.count_lookup(request, num_cached, from_host)
        plan.new.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                block_ids=bm.get_block_ids(request.request_id),
                num_computed_tokens=num_cached,
                sampling_params=request.sampling_params,
            )
        )
        plan.add(request, num_new)

    # ---- after the step --------------------------------------------------------------------------

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        finish_reasons: Mapping[str, FinishReason] | None = None,
        deferred: Collection[str] = (),
    ) -> list[Request]:
        """Apply a step's sampled tokens: append them, apply stop rules, cache the blocks now full.

        sampled_token_ids must hold a token for every request the step sampled
        (`scheduler_output.sampling_request_ids`). finish_reasons: requests that end on their token
        for a reason only the runner sees (a grammar complete or failed); it goes before the stop
        rules, since it says more. Requests finished or aborted since the step was
        scheduled are skipped; one preempted since then still gets its token (it was sampled from
        its whole context). deferred: requests the step gave no token although it reached their
        last one (`defer`). Returns the requests that got a token (finished or not), in
        scheduling order.
        """
        updated: list[Request] = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request_id in deferred:
                self.defer(request)
                continue
            token_id = sampled_token_ids.get(request_id)
            if token_id is None and request_id in scheduler_output.sampling_request_ids:
                raise ValueError(f"request {request_id!r} reached its last token but nothing was sampled")
            if token_id is not None:
                request.num_output_placeholders -= 1
                request.append_output_token(token_id)
            # Blocks whose tokens are all known and computed (or being computed by a step already
            # queued after this one: it runs first on the device) can serve other requests.
            known = min(request.num_computed_tokens, request.num_tokens)
            self.block_manager.cache_full_blocks(request, known)
            if token_id is None:
                continue
            reason = (finish_reasons or {}).get(request_id) or request.stop_reason(token_id, self._max_len)
            if reason is not None:
                self._finish(request, reason)
            updated.append(request)
        return updated

    def defer(self, request: Request) -> None:
        """A step computed the request's last token but sampled nothing from it (its grammar's mask
        was not ready in time): that position is computed again by a later step. A step scheduled
        after this one read the token that never came, so it is deferred too; until every such
        step is back the request is held (`_held_for_deferred`), then it resumes from its last
        known token."""
        request.num_output_placeholders -= 1
        request.num_computed_tokens = max(0, request.num_computed_tokens - 1)
        request.held_for_deferred = request.num_output_placeholders > 0
        self._num_deferred_steps += 1

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        self._finished_ids.add(request.request_id)


def _host_tier_stats(bm: BlockManager) -> dict[str, int]:
    """EngineStats' host-tier fields, in blocks (the engine turns moved blocks into bytes)."""
    tier = bm.host_tier
    if tier is None:
        return {}
    return {
        "host_num_total_blocks": tier.num_blocks,
        "host_num_used_blocks": tier.num_used_blocks,
        "host_prefix_hits": bm.host_hits,
        "host_offloaded_blocks": tier.counters.offloaded_blocks,
        "host_loaded_blocks": tier.counters.loaded_blocks,
        "host_evicted_blocks": tier.counters.evicted_blocks,
        "host_swapped_out_requests": tier.counters.swapped_out_requests,
        "host_spilled_blocks": tier.counters.spilled_blocks,
    }
