"""LLMEngine: the continuous-batching loop's one step, over a model, a paged KV pool and a scheduler.

`add_request` validates and queues; `step` schedules, runs the model once and returns per-request
deltas. A bad request is refused at `add_request` with InvalidRequestError and never reaches the
loop, so it cannot stop the engine from serving the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.config.scheduler import SchedulerConfig
from tgserve.server.core.request import FinishReason, Request
from tgserve.server.core.scheduler import Scheduler
from tgserve.server.core.scheduler_output import SchedulerOutput
from tgserve.server.core.step_timing import StepClock, step_kind
from tgserve.server.distributed.tensor_parallel import (
    TensorParallel,
    init_tensor_parallel,
    shutdown_tensor_parallel,
)
from tgserve.server.engine.grammar_gate import GrammarGate
from tgserve.server.engine.model_shard import build_shard
from tgserve.server.engine.shard_workers import WorkerWatch, free_tcp_address, shard_device, start_workers
from tgserve.server.engine.warm_up import warm_up
from tgserve.server.execution.memory import MemoryProfile
from tgserve.server.execution.runner import LaunchedStep, RunnerOutput
from tgserve.server.kv_cache.hot_blocks import HotBlockCache
from tgserve.server.loading.description import ModelDescription, eos_token_ids, load_model_description
from tgserve.server.loading.source import load_tokenizer
from tgserve.server.protocol.grammar import check_grammar
from tgserve.server.protocol.outputs import EngineStats, RequestOutput, TokenLogprob
from tgserve.server.protocol.params import InvalidRequestError, SamplingParams, check_prompt_tokens
from tgserve.server.sampling.grammar_backends import check_guided_decoding_backend
from tgserve.server.sampling.guided import GuidedMatchers

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005  # an idle loop's pause for a grammar being compiled
DEAD_WORKER_WAIT_S = 1.0  # after a failed step, how long a shard worker has to be seen dead


class LLMEngine:
    """One model served by continuous batching over a paged KV cache: on one device, or as rank 0
    of `tensor_parallel_size` shards whose workers take every step with it."""

    def __init__(self, args: EngineArgs, described: ModelDescription | None = None) -> None:
        self.args = args
        check_guided_decoding_backend(args.guided_decoding_backend)  # before the (slow) load
        described = described or load_model_description(args)
        self.device, self.dtype, self.source = described.device, described.dtype, described.source
        self.config, self.max_model_len = described.config, described.max_model_len
        self.model_id = args.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
        self.tokenizer = load_tokenizer(self.source, args.trust_remote_code)
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer, self.source)
        self.tp, self.workers = self._join_shards()
        self.shard = build_shard(args, described, self.device, self.tp)  # refuses what it cannot serve
        self.vocab_size = int(self.config.vocab_size)
        self.runner, self.num_blocks = self.shard.runner, self.shard.num_blocks
        self.runner.guided = GuidedMatchers(
            lambda: (self.tokenizer, self.eos_token_ids),
            self.vocab_size,
            args.guided_decoding_backend,
            pinned=self.device.type == "cuda",
        )
        self.memory_profile: MemoryProfile | None = self.shard.memory_profile
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                num_blocks=self.num_blocks,
                enable_prefix_caching=args.enable_prefix_caching,
                whole_prompt_tokens=self.shard.whole_prompt_tokens,
                num_host_blocks=self.shard.num_host_blocks,
                spill_keep=self.shard.spill_keep,
                spill_min_context=self.shard.spill_min_context,
                first_host_block_id=self.shard.first_host_block_id,
            )
        )
        self._grow_host_tier()
        self._grammars = GrammarGate()  # guided requests whose grammars are compiling
        self._dropped_grammars: set[str] = set()  # aborted there: their runners' matchers to drop
        self._last_step = (0, 0)
        self.step_clock = StepClock()  # step durations since start (or the last reset_counters)
        self.async_scheduling = (
            self.device.type == "cuda" if args.async_scheduling is None else args.async_scheduling
        )
        self._in_flight: tuple[SchedulerOutput, LaunchedStep, float] | None = None
        # Prompt log-probabilities gathered over a request's prefill chunks, sent with its first token.
        self._prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        warm = self.device.type == "cuda" if args.warm_up is None else args.warm_up
        if warm:
            seconds = warm_up(self, self.num_blocks, self.shard.backend.whole_prompt_tokens)
            logger.info("warm-up requests took %.2f s", seconds)
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens in %s: the longest servable context is %d tokens",
            self.source.display_name,
            self.num_blocks,
            args.block_size,
            self.kv_cache_dtype_name,
            min(self.max_model_len, self.max_pool_tokens),
        )

    @property
    def max_pool_tokens(self) -> int:
        """The most tokens one request's KV can take: the pool's, and where requests spill to the
        host tier (the long-context tier), the host tier's too."""
        return self.scheduler.max_tokens_in_pool

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.shard.specs[0].dtype

    @property
    def kv_cache_dtype_name(self) -> str:
        """What the KV cache stores, as torch names it (float8_e4m3fn, bfloat16, ...)."""
        return str(self.kv_cache_dtype).removeprefix("torch.")

    def _join_shards(self) -> tuple[TensorParallel, list]:
        """With several shards: start ranks 1..N-1 and join their process group as rank 0."""
        size = self.args.tensor_parallel_size
        if size == 1:
            return TensorParallel(), []
        if self.device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"--num-shard {size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
        address = free_tcp_address()
        workers = start_workers(self.args, address)
        self._watch = WorkerWatch(workers)
        tp = init_tensor_parallel(0, size, address)
        self.device = shard_device(self.device, 0)
        return tp, workers

    def close(self) -> None:
        """Stop the shard workers (nothing to do with one shard). Idempotent."""
        if self.workers:
            self._watch.stop()
            self.tp.broadcast_object(None)
            for worker in self.workers:
                worker.join(timeout=30)
                if worker.exitcode is None:
                    logger.warning("shard worker %s did not stop within 30 s", worker.name)
                elif worker.exitcode != 0:
                    logger.warning("shard worker %s ended with exit code %d", worker.name, worker.exitcode)
            self.workers, self.tp = [], TensorParallel()
            shutdown_tensor_parallel()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate and queue a request; raises InvalidRequestError naming the problem and the limit."""
        self._validate(request_id, prompt_token_ids)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids)
        if params.guided is not None:
            check_grammar(params.guided)  # a grammar that does not compile never reaches the loop
            self._grammars.hold(request)  # scheduled once its matcher is built
        else:
            self.scheduler.add_request(request)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = []

    def _validate(self, request_id: str, prompt: list[int]) -> None:
        if self.scheduler.get_request(request_id) is not None or request_id in self._grammars:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_prompt_tokens(prompt, self.vocab_size)
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens but the model's context is {self.max_model_len} tokens: "
                f"at most {self.max_model_len - 1} prompt tokens leave room for one new token"
            )
        capacity = self.max_pool_tokens
        if len(prompt) + 1 > capacity:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens but the KV cache holds at most {capacity} tokens "
                f"({self.kv_cache_dtype_name}; --kv-cache-dtype fp8 or int8 holds about twice those of bf16)"
            )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self._dropped_grammars.update(self._grammars.abort(request_ids, self.runner.guided))
        self.scheduler.abort_requests(request_ids)
        for request_id in request_ids:
            self._prompt_logprobs.pop(request_id, None)

    def finish_request(self, request_id: str, reason: str | FinishReason) -> None:
        """End a request early, e.g. with "stop_sequence" when a stop string was found downstream."""
        self.scheduler.finish_request(request_id, FinishReason(reason))
        self._prompt_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or len(self._grammars) > 0

    def needs_step(self) -> bool:
        """Unfinished requests, finished ones (aborts, stop strings) whose state a step releases, or
        a step in flight whose output is still to be read."""
        return (
            self.has_unfinished_requests()
            or self.scheduler.has_finished_requests()
            or self._in_flight is not None
        )

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, and report every request that gained a token or finished.

        With async scheduling the outputs reported are the previous step's: this step was scheduled
        and queued on the device before they were read, so the device never waits for the host.
        """
        try:
            return self._step()
        except Exception as exc:
            # A collective with a dead shard worker fails as a reset connection (gloo) or a timeout:
            # say which worker died instead.
            why = self._watch.dead_worker(wait_s=DEAD_WORKER_WAIT_S) if self.workers else None
            if why is not None:
                raise RuntimeError(why) from exc
            raise

    def _step(self) -> list[RequestOutput]:
        started = time.monotonic()
        self._grow_host_tier()
        for request in self._grammars.release_ready(self.runner.guided):
            self.scheduler.add_request(request)
        held = self.runner.guided.waiting_for_masks()
        scheduler_output = self._with_grammars(self.scheduler.schedule(hold=held), held)
        self.tp.broadcast_object(scheduler_output)  # to the other shards, if any
        launched = (scheduler_output, self.runner.launch(scheduler_output), started)
        if not self.async_scheduling:
            return self._apply(*launched)
        previous = self._in_flight
        self._in_flight = None if scheduler_output.is_empty else launched
        return self._apply(*previous) if previous is not None else []

    def _with_grammars(self, scheduler_output: SchedulerOutput, held: set[str]) -> SchedulerOutput:
        """The step's output with the grammars that arrived for every runner to compile, and the
        requests aborted while theirs compiled; an idle step pauses for a compile, or for the mask
        of a request `held` out of it, rather than spin."""
        arrived, dropped = self._grammars.take_arrivals(), self._dropped_grammars
        if scheduler_output.is_empty and (len(self._grammars) or held) and not arrived:
            self.runner.guided.wait_for_any(GRAMMAR_WAIT_S)
        if not arrived and not dropped:
            return scheduler_output
        self._dropped_grammars = set()
        finished = scheduler_output.finished_request_ids | dropped
        return replace(scheduler_output, grammars_to_prepare=arrived, finished_request_ids=finished)

    def _grow_host_tier(self) -> None:
        """Host memory allocated since the last step (`HostKVPool` allocates it in the background
        on CUDA) joins the host tier."""
        if self.shard.host_pool is not None:
            self.scheduler.grow_host_tier(self.shard.host_pool.ready_blocks)

    def _apply(
        self, scheduler_output: SchedulerOutput, launched: LaunchedStep, started: float
    ) -> list[RequestOutput]:
        """Read a launched step's tokens and hand them to the scheduler."""
        runner_output = self.runner.collect(launched)
        tokens, seqs = scheduler_output.total_num_scheduled_tokens, len(scheduler_output.num_scheduled_tokens)
        self._last_step = (tokens, seqs)
        if seqs:
            kind = step_kind(len(scheduler_output.scheduled_new_requests), tokens, seqs)
            self.step_clock.record(time.monotonic() - started, kind)
        updated = self.scheduler.update_from_output(
            scheduler_output,
            runner_output.sampled_token_ids,
            runner_output.finish_reasons,
            runner_output.deferred,
        )
        self._collect_prompt_logprobs(runner_output)
        return [self._output(request, runner_output) for request in updated]

    def _collect_prompt_logprobs(self, runner_output: RunnerOutput) -> None:
        for request_id, (first, scored) in runner_output.prompt_logprobs.items():
            collected = self._prompt_logprobs.get(request_id)
            if collected is None:
                continue
            # Position p of the prompt is entry p - 1. A preempted request recomputes its prompt:
            # positions already collected are skipped.
            collected.extend(scored[len(collected) - (first - 1) :])

    def _output(self, request: Request, runner_output: RunnerOutput) -> RequestOutput:
        sampled = request.request_id in runner_output.sampled_token_ids
        logprob = runner_output.logprobs.get(request.request_id)
        prompt_logprobs = None
        if sampled or request.is_finished:
            collected = self._prompt_logprobs.pop(request.request_id, None)
            prompt_logprobs = None if collected is None else [None, *collected]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[request.output_token_ids[-1]] if sampled else [],
            new_logprobs=[logprob] if logprob is not None else None,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_output_tokens=request.num_output_tokens,
            prompt_logprobs=prompt_logprobs,
            scheduled_at=request.first_scheduled_time,
        )

    def reset_counters(self) -> None:
        """Zero what stats() counts since start (after the engine's own warm-up requests, so that
        metrics count only what clients asked)."""
        self.scheduler.reset_counters()
        if (hot := self._hot_blocks) is not None:
            hot.reset_counts()
        self._last_step = (0, 0)
        self.step_clock = StepClock()

    @property
    def _hot_blocks(self) -> HotBlockCache | None:
        host = self.shard.host_pool
        return None if host is None else host.hot_blocks

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        tokens, seqs = self._last_step
        hot_hits, hot_misses = (0, 0) if self._hot_blocks is None else self._hot_blocks.recent_counts()
        return EngineStats(
            **{
                **stats.__dict__,
                "num_waiting": stats.num_waiting + len(self._grammars),  # their grammars compiling
                "step_num_tokens": tokens,
                "step_num_seqs": seqs,
                "host_block_bytes": self.shard.host_block_bytes if self.shard.num_host_blocks else 0,
                "step_durations": self.step_clock.snapshot(),
                "host_hot_block_hits": hot_hits,
                "host_hot_block_misses": hot_misses,
            }
        )
