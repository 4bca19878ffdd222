"""StaticBatchEngine: the optimum-habana fallback served through `LLMEngine`'s interface.

An architecture with no native tgserve implementation runs on a Gaudi as optimum-habana's Gaudi class
(`fallback_model.py`), whose KV cache is static: `rows` sequences of `max_len` positions in the
layout of the model's family (`layout_for_config`). Batching is tgi-gaudi's: each step decodes
every occupied row once, samples with the project's `Sampler`, applies `Scheduler`'s stop rules (the
static length as the length limit), filters finished and aborted rows out, and then prefills waiting
requests one at a time into the freed rows, each taking its first token. Every request gains at most
one token per step, as with `LLMEngine`; outputs, errors and stats have the same types, so
the engine process (`engine/service.py`) and `LLM` drive either engine alike through the `Engine` interface.

Static shapes (`args.static_shapes`, by default on a Gaudi only): prompts are left-padded to
`args.buckets`' prompt-length buckets (decode steps always have one shape), and unless
`args.buckets.warmup` is off every one of those shapes runs once before serving
(`StaticBatch.warm_up`), so that no user waits for a graph compile.

The static cache maps onto the engine's metrics as rows of one block each: `num_total_blocks` is
`rows` and `args.block_size` is `max_len`. No prefix cache, no preemption, no prompt chunking.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.core.request import FinishReason, Request, RequestStatus
from tgserve.server.core.step_timing import StepClock, step_kind
from tgserve.server.kv_cache.spec import layer_sliding_windows
from tgserve.server.loading.description import ModelDescription, eos_token_ids, load_model_description
from tgserve.server.loading.source import load_tokenizer
from tgserve.server.models.registry import UnsupportedModelError, architecture_name, check_supported
from tgserve.server.protocol.outputs import EngineStats, RequestOutput, TokenLogprob
from tgserve.server.protocol.params import InvalidRequestError, SamplingParams
from tgserve.server.sampling.sampler import Sampler

from .cache_layouts import layout_for_config
from .fallback_model import load_fallback_model
from .static_batch import StaticBatch, prompt_buckets
from .static_requests import output_delta, prompt_logprobs, sampling_row, validate_prompt

logger = logging.getLogger(__name__)


def check_windows_fit(config: Any, width: int) -> None:
    """Refuse sliding-window attention narrower than the static rows. A row keeps its keys at fixed
    columns of the static width, the unused ones masked, and a decode step's token comes after all
    of them; transformers' sliding-window masks count columns, not positions, so a window that does
    not reach across the width would hide the row's own recent tokens (on CPU: Mistral with a
    16-token window over rows of 24 gives other tokens from its third step on). Rows of at most the
    window less one position are exact."""
    windows = [window for window in layer_sliding_windows(config) if window is not None]
    if windows and width > min(windows) - 1:
        raise UnsupportedModelError(
            f"{architecture_name(config)}: sliding-window attention ({min(windows)} tokens) over static rows of "
            f"{width} positions: the optimum-habana fallback would mask a row's own recent tokens; serve it "
            f"with --max-total-tokens {min(windows) - 1} or less"
        )


class StaticBatchEngine:
    """One model served by continuous batching over a static KV cache of `args.max_num_seqs` rows by
    `max_model_len` positions: `LLMEngine`'s public interface, one device, no tensor parallelism."""

    def __init__(self, args: EngineArgs, described: ModelDescription | None = None) -> None:
        """`described`: the model's description when the caller has read it already (to choose this
        engine), else read here from `args`."""
        if args.tensor_parallel_size != 1:
            raise ValueError("the optimum-habana fallback runs on one device: use --num-shard 1")
        if args.load_format != "auto":
            raise ValueError(f"the optimum-habana fallback loads checkpoints only, not {args.load_format!r}")
        if args.kv_cache_dtype != "auto":
            raise ValueError(
                "the optimum-habana fallback keeps its KV cache in the model's dtype: use --kv-cache-dtype auto"
            )
        described = described or load_model_description(args)
        self.device, self.dtype, self.source = described.device, described.dtype, described.source
        self.config, self.max_model_len = described.config, described.max_model_len
        check_supported(architecture_name(self.config), args.trust_remote_code)
        check_windows_fit(self.config, self.max_model_len)
        self.args = dataclasses.replace(args, block_size=self.max_model_len)  # one row, one block
        self.max_pool_tokens = self.max_model_len  # a request's row holds the model's whole length
        self.model_id = args.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
        self.tokenizer = load_tokenizer(self.source, args.trust_remote_code)
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer, self.source)
        self.vocab_size = int(self.config.vocab_size)
        model = load_fallback_model(
            self.source, self.config, self.dtype, self.device, args.trust_remote_code, args.allow_pickle
        )
        layout = layout_for_config(self.config, self.dtype, self.device)
        # As for the paged engine: static shapes by default on a Gaudi, where each new one compiles.
        static = self.device.type == "hpu" if args.static_shapes is None else args.static_shapes
        buckets = prompt_buckets(args.buckets, self.max_model_len) if static else None
        self.batch: StaticBatch[Request] = StaticBatch(
            model, layout, args.max_num_seqs, self.max_model_len, buckets
        )
        if static and args.buckets.warmup:
            self.batch.warm_up()
        self.sampler = Sampler()
        self.waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # unfinished ones, waiting or running
        self._last_step = (0, 0)
        self.step_clock = StepClock()
        logger.info(
            "static-batch engine ready: %s, %d rows of %d positions (%s layout), prompts padded to %s",
            self.source.display_name,
            args.max_num_seqs,
            self.max_model_len,
            type(layout).__name__,
            buckets or "their own lengths",
        )

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The models' own static caches keep the model's dtype (--kv-cache-dtype fp8 is refused)."""
        return self.dtype

    def close(self) -> None:
        """Nothing to stop: one process, one device. Idempotent."""

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate and queue a request; raises InvalidRequestError naming the problem and the limit."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        if params.guided is not None:
            raise InvalidRequestError(
                "guided decoding is not supported by the optimum-habana fallback engine"
            )
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids)
        self._requests[request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests with "abort"; unknown (or already finished) ids are ignored."""
        for request_id in request_ids:
            self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: str | FinishReason) -> None:
        """End a request early, e.g. with "stop_sequence" when a stop string was found downstream.

        It is reported no further; its row is freed by the next step.
        """
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason(reason))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def needs_step(self) -> bool:
        """Unfinished requests, or rows of finished ones (aborts, stop strings) a step must free."""
        return bool(self._requests) or len(self.batch.running) > 0

    # -- the loop -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Decode every occupied row once, free finished rows, prefill waiting requests into free rows;
        report every request that gained a token."""
        started = time.monotonic()
        self.batch.retire(_is_finished)  # aborted or stopped downstream since the last step
        decoded = len(self.batch.running)
        outputs = self._decode() if decoded else []
        self.batch.retire(_is_finished)
        admitted = self._admit()
        prompt_tokens = sum(output.num_prompt_tokens for output in admitted)
        self._last_step = (decoded + prompt_tokens, decoded + len(admitted))
        if decoded or admitted:
            kind = step_kind(len(admitted), *self._last_step)
            self.step_clock.record(time.monotonic() - started, kind)
        return outputs + admitted

    def _decode(self) -> list[RequestOutput]:
        running = self.batch.running
        logits = self.batch.decode([request.output_token_ids[-1] for request in running])
        return self._sample(list(running), logits)

    def _admit(self) -> list[RequestOutput]:
        """Prefill waiting requests one at a time while rows are free; insert those not finished."""
        outputs = []
        while self.waiting and self.batch.num_free_rows:
            request = self.waiting.popleft()
            request.mark_running()
            logits, kv = self.batch.prefill(request.prompt_token_ids)
            outputs += self._sample([request], logits[-1:], prompt_logprobs(request, logits))
            if not request.is_finished:
                self.batch.insert(request, kv, request.num_prompt_tokens)
        return outputs

    def _sample(
        self,
        requests: list[Request],
        logits: torch.Tensor,
        prompt_scores: list[TokenLogprob | None] | None = None,
    ) -> list[RequestOutput]:
        """Sample one token per request from `logits` `[n, vocab]`, apply the stop rules, report."""
        sampled = self.sampler(logits, [sampling_row(request) for request in requests])
        outputs = []
        for request, token, logprob in zip(
            requests, sampled.token_ids.tolist(), sampled.logprobs, strict=True
        ):
            request.append_output_token(token)
            reason = request.stop_reason(token, self.max_model_len)
            if reason is not None:
                self._finish(request, reason)
            outputs.append(output_delta(request, logprob, prompt_scores))
        return outputs

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]

    def reset_counters(self) -> None:
        """Zero the step timings and the last step's size (nothing else is counted here)."""
        self._last_step = (0, 0)
        self.step_clock = StepClock()

    def stats(self) -> EngineStats:
        """Rows of the static cache stand for KV blocks; nothing is cached or preempted."""
        running = sum(not request.is_finished for request in self.batch.running)
        tokens, seqs = self._last_step
        return EngineStats(
            num_running=running,
            num_waiting=len(self.waiting),
            num_free_blocks=self.batch.num_free_rows,
            num_total_blocks=self.batch.cache.rows,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            step_num_tokens=tokens,
            step_num_seqs=seqs,
            step_durations=self.step_clock.snapshot(),
        )


def _is_finished(request: Request) -> bool:
    return request.is_finished
