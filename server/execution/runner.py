"""The model runner: turns a SchedulerOutput into flat tensors, runs the step through its executor,
samples.

It keeps its own copy of each scheduled request's tokens and blocks (new requests arrive in full,
running ones as diffs) and appends the tokens it samples, as the scheduler does on its side.

A step is launched (`launch`: inputs, forward, sampling, all queued on the device) and collected
later (`collect`: the sampled tokens read on the host). Between the two the next step can be
launched: a token still on its way sits in the request's list as a placeholder, and the next step
reads it from the device tensor it was sampled into, so the host never waits for the GPU in between.
Requests whose next token depends on the last one's value (penalties, a grammar) are the exception:
a step that samples them waits for the step before.

A guided request whose mask is not ready soon after the step's logits (`guided.LATE_MASK_GRACE_S`)
gets no token from that step: the step is deferred for it (`RunnerOutput.deferred`), and the
scheduler computes that position again later. A step already launched after it read the token that
never came: that row is computed and not sampled, deferred too (`StepInputs.unknown_inputs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.core.request import FinishReason
from tgserve.server.core.scheduler_output import SchedulerOutput
from tgserve.server.device.transfer import HostCopies, pinned_to, to_device
from tgserve.server.execution.executor import StepExecutor
from tgserve.server.execution.forward import ModelForward
from tgserve.server.execution.step_inputs import PromptLogprobRows, StepInputs, padded_block_table
from tgserve.server.execution.step_rows import HostRows, span_slots
from tgserve.server.kv_cache.host_pool import HostKVPool
from tgserve.server.kv_cache.tail_blocks import TailBlocks
from tgserve.server.protocol.outputs import TokenLogprob
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.sampling.guided import LATE_MASK_GRACE_S, GuidedMatchers, StepMasks, token_mask
from tgserve.server.sampling.sampler import LogprobTensors, Sampler, SamplingRow, logprob_tensors

# A sampled token whose value is still on the device.
PLACEHOLDER = -1


@dataclass
class RunnerRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams


@dataclass
class RunnerOutput:
    """Sampled tokens of the requests that reached the end of their tokens this step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request id -> (position of the first prompt token scored, its log-probability and the next ones')
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Requests that end on this step's token for a reason the scheduler cannot see (their grammar).
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    # Requests the step reached the last token of but gave no token (their mask was late).
    deferred: set[str] = field(default_factory=set)


@dataclass
class LaunchedStep:
    """A step queued on the device whose results the host has not read yet."""

    sampled_request_ids: list[str]
    token_ids: torch.Tensor | None = None  # [len(sampled_request_ids)] on the device
    placeholder_index: list[int] = field(default_factory=list)  # where each token goes in its list
    logprob_rows: list[int] = field(default_factory=list)
    copies: HostCopies | None = None  # token ids, then logprob tensors, then prompt logprob tensors
    logprobs: LogprobTensors | None = None
    prompt_rows: PromptLogprobRows = field(default_factory=PromptLogprobRows)
    prompt_logprobs: LogprobTensors | None = None
    deferred: set[str] = field(default_factory=set)  # reached their last token, sampled nothing
    output: RunnerOutput | None = None  # once collected

    def row_of(self) -> dict[str, int]:
        return {request_id: row for row, request_id in enumerate(self.sampled_request_ids)}

    def device_results(self) -> list[torch.Tensor]:
        """What the host reads of this step, in this order: token ids, logprobs, prompt logprobs."""
        tensors = [self.token_ids] if self.token_ids is not None else []
        for logprobs in (self.logprobs, self.prompt_logprobs):
            tensors += logprobs.tensors() if logprobs is not None else []
        return tensors


class ModelRunner:
    """One device's side of every request: its tokens and blocks, each step's inputs, the sampler.
    The step's forward runs through `executor`, the shard's choice (eager, graphs, static shapes)."""

    def __init__(
        self,
        forward: ModelForward,
        executor: StepExecutor,
        block_size: int,
        device: torch.device,
        host_pool: HostKVPool | None = None,
        tails: TailBlocks | None = None,
    ) -> None:
        self.forward = forward
        self.tails = tails  # an 8-bit cache's tail slots: each step's current blocks mapped to them
        self.host_pool = host_pool  # the host tier's memory: each step's block copies run through it
        self.executor = executor
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # Guided decoding's matchers; the engine gives them the tokenizer (which the runner does not
        # know). Without one, every guided request finishes with "grammar_error".
        self.guided = GuidedMatchers(None, 0)
        self.requests: dict[str, RunnerRequestState] = {}
        self._pending: LaunchedStep | None = None  # the last step launched and not yet collected
        # How long sampling waits for guided masks past the logits, at least (None: for every one;
        # `guided.mask_grace_s`). Ranks of a tensor-parallel group must agree on which rows
        # sample, so they wait for all.
        self.late_mask_grace_s: float | None = LATE_MASK_GRACE_S
        self._launched_at = 0.0  # when the step being launched began (perf_counter)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its tokens."""
        return self.collect(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step on the device: inputs, forward, sampling, and the copies of its results."""
        self._launched_at = time.perf_counter()
        for request_id, spec in scheduler_output.grammars_to_prepare:  # compiled beside the loop
            self.guided.prepare(request_id, spec)
        if scheduler_output.kv_transfers:  # before anything of this step writes the pool
            self.host_pool.apply(scheduler_output.kv_transfers)
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return LaunchedStep([], output=RunnerOutput())
        known_later = self._pending is not None and self._needs_known_tokens(scheduler_output)
        inputs = self._prepare_inputs(scheduler_output)
        masks = None if known_later else self._masks_beside_the_forward(inputs.sampled_request_ids)
        logits = self.executor.run(inputs)[: inputs.logits_indices.shape[0]]  # padding rows dropped
        self.forward.backend.mark_step()
        if known_later:
            # Penalties read the tokens still in flight, grammars consume them before their masks:
            # only the sampling needs them, so they are read with this step's forward already
            # queued (its inputs took them on the device), and the device does not wait for the host.
            self.collect(self._pending)
            masks = self._masks_beside_the_forward(inputs.sampled_request_ids)
        num_sampled = len(inputs.sampled_request_ids)
        step = self._sample(logits[:num_sampled], inputs.sampled_request_ids, masks)
        step.deferred.update(inputs.unknown_inputs)
        step.prompt_rows = inputs.prompt_rows
        step.prompt_logprobs = self._score_prompt(logits[num_sampled:], inputs.prompt_rows)
        self.forward.backend.mark_step()
        step.copies = HostCopies(step.device_results())
        self._pending = step
        return step

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """The step's sampled tokens and log-probabilities, read on the host (waits for that step only)."""
        if step.output is not None:
            return step.output
        # The host copies in the order `launch` made them: token ids, logprobs, prompt logprobs.
        host = iter(step.copies.wait() if step.copies is not None else [])
        token_ids = next(host).tolist() if step.token_ids is not None else []
        result = RunnerOutput(deferred=step.deferred)
        for request_id, index, token_id in zip(
            step.sampled_request_ids, step.placeholder_index, token_ids, strict=True
        ):
            if request_id in step.deferred:
                continue
            state = self.requests.get(request_id)
            if state is not None and index < len(state.token_ids) and state.token_ids[index] == PLACEHOLDER:
                state.token_ids[index] = token_id
            result.sampled_token_ids[request_id] = token_id
        if len(self.guided):
            # Preempted since (no state) or not, a request keeps its token: so does its grammar.
            result.finish_reasons.update(self.guided.consume_step(result.sampled_token_ids))
        if step.logprobs is not None:
            logprobs = step.logprobs.replace_tensors([next(host) for _ in step.logprobs.tensors()]).to_list()
            for row, logprob in zip(step.logprob_rows, logprobs, strict=True):
                if step.sampled_request_ids[row] not in step.deferred:
                    result.logprobs[step.sampled_request_ids[row]] = logprob
        if step.prompt_logprobs is not None:
            prompt = step.prompt_logprobs
            scored = prompt.replace_tensors([next(host) for _ in prompt.tensors()]).to_list()
            result.prompt_logprobs = self._split_prompt_logprobs(scored, step.prompt_rows)
        step.output = result
        if self._pending is step:
            self._pending = None
        return result

    def _needs_known_tokens(self, out: SchedulerOutput) -> bool:
        """A request with penalties reads its whole output, a guided one's mask follows its last
        token: their tokens in flight must be known before this step samples."""
        pending = set(self._pending.sampled_request_ids)
        return any(
            self.requests[request_id].params.needs_penalties
            or self.requests[request_id].params.guided is not None
            for request_id in out.num_scheduled_tokens
            if request_id in pending
        )

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids | out.preempted_request_ids:
            self.requests.pop(request_id, None)
            if self.tails is not None:
                self.tails.release(request_id)
        for request_id in out.finished_request_ids - out.preempted_request_ids:
            self.guided.remove(request_id)  # a preempted request keeps its matcher
        for new in out.scheduled_new_requests:
            self.requests[new.request_id] = RunnerRequestState(
                list(new.token_ids),
                new.num_prompt_tokens,
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
            )
            if new.sampling_params.guided is not None:
                output = new.token_ids[new.num_prompt_tokens :]
                self.guided.add(new.request_id, new.sampling_params.guided, output)
        for cached in out.scheduled_cached_requests:
            state = self.requests[cached.request_id]
            for index, block_id in cached.moved_blocks:  # spilled to the host tier
                state.block_ids[index] = block_id
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _scheduled_ids(self, out: SchedulerOutput) -> list[str]:
        return [r.request_id for r in out.scheduled_new_requests] + [
            r.request_id for r in out.scheduled_cached_requests
        ]

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        ids, positions, slots = HostRows(), HostRows(), HostRows()
        query_start_loc, seq_lens, logits_indices, sampled = [0], [], [], []
        prompt_rows, prompt_indices = PromptLogprobRows(), []
        block_rows = []
        current_blocks: list[tuple[str, int, int, int]] = []  # for the tail slots
        in_flight: list[tuple[int, str]] = []  # (input row, request) for tokens still on the device
        unknown_inputs: list[str] = []
        bs = self.block_size
        for request_id in self._scheduled_ids(out):
            state = self.requests[request_id]
            start, count = state.num_computed_tokens, out.num_scheduled_tokens[request_id]
            end = start + count
            if count == 1:  # a decoding request: most rows of most steps
                if start == len(state.token_ids):  # the step before deferred this token
                    unknown_inputs.append(request_id)
                    ids.append(0)  # any token: this row's key is computed again once the token is known
                else:
                    if state.token_ids[start] == PLACEHOLDER:
                        in_flight.append((len(ids), request_id))
                    ids.append(state.token_ids[start])
                positions.append(start)
                slots.append(state.block_ids[start // bs] * bs + start % bs)
            else:
                if state.token_ids[end - 1] == PLACEHOLDER:  # only a lone decode token can be in flight
                    raise RuntimeError(f"request {request_id!r} was scheduled past its known tokens")
                # Through numpy: torch.tensor on a 128K-int list takes ~6.6 ms, np.array ~1.8.
                ids.extend_tensor(torch.from_numpy(np.array(state.token_ids[start:end], dtype=np.int64)))
                positions.extend_tensor(torch.arange(start, end, dtype=torch.int64))
                slots.extend_tensor(span_slots(state.block_ids, start, end, bs))
            query_start_loc.append(query_start_loc[-1] + count)
            seq_lens.append(end)
            block_rows.append(state.block_ids)
            if self.tails is not None:  # (request, its current block, rows of it before and after the step)
                first_of_current = (end - 1) // bs * bs
                current = state.block_ids[(end - 1) // bs]
                current_blocks.append(
                    (request_id, current, max(0, start - first_of_current), end - first_of_current)
                )
            if end == len(state.token_ids):
                logits_indices.append(query_start_loc[-1] - 1)
                sampled.append(request_id)
            scored_end = min(end, state.num_prompt_tokens - 1)  # position p's logits score token p + 1
            if state.params.prompt_logprobs is not None and start < scored_end:
                prompt_rows.spans.append((request_id, start + 1, scored_end - start))
                prompt_rows.target_ids.extend(state.token_ids[start + 1 : scored_end + 1])
                prompt_rows.top_n.extend([state.params.prompt_logprobs] * (scored_end - start))
                prompt_indices.extend(range(query_start_loc[-2], query_start_loc[-2] + scored_end - start))
        if self.tails is not None:
            self.tails.plan_step(current_blocks)
        metadata = AttentionMetadata(
            query_start_loc=to_device(query_start_loc, torch.int32, self.device),
            seq_lens=to_device(seq_lens, torch.int32, self.device),
            block_tables=pinned_to(padded_block_table(block_rows), self.device),
            slot_mapping=slots.to(self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return StepInputs(
            input_ids=self._fill_in_flight(ids.to(self.device), in_flight),
            positions=positions.to(self.device),
            logits_indices=to_device(logits_indices + prompt_indices, torch.int64, self.device),
            metadata=metadata,
            sampled_request_ids=sampled,
            prompt_rows=prompt_rows,
            unknown_inputs=unknown_inputs,
        )

    def _fill_in_flight(self, input_ids: torch.Tensor, in_flight: list[tuple[int, str]]) -> torch.Tensor:
        """Input rows whose token the last step is still sampling take it from that step's device tensor."""
        if not in_flight:
            return input_ids
        row_of = self._pending.row_of()
        rows = to_device([row for row, _ in in_flight], torch.int64, self.device)
        sources = to_device([row_of[request_id] for _, request_id in in_flight], torch.int64, self.device)
        input_ids[rows] = self._pending.token_ids[sources]
        return input_ids

    @staticmethod
    def _score_prompt(logits: torch.Tensor, rows: PromptLogprobRows) -> LogprobTensors | None:
        if not rows.spans:
            return None
        return logprob_tensors(logits, to_device(rows.target_ids, torch.int64, logits.device), rows.top_n)

    @staticmethod
    def _split_prompt_logprobs(
        scored: list[TokenLogprob], rows: PromptLogprobRows
    ) -> dict[str, tuple[int, list[TokenLogprob]]]:
        result, offset = {}, 0
        for request_id, first, count in rows.spans:
            result[request_id] = (first, scored[offset : offset + count])
            offset += count
        return result

    def _masks_beside_the_forward(self, request_ids: list[str]) -> StepMasks | None:
        """The guided rows' token masks, computed on worker threads while the forward runs (on the
        CPU the forward holds this thread; on CUDA it is queued and the GPU runs it). Their
        matchers have consumed every earlier token: the step before was collected first."""
        if not self.guided.vocab_size:
            return None  # no vocabulary known before the logits (then masked in _sample)
        return self.guided.start_masks(request_ids, self.guided.vocab_size)

    def _sample(
        self, logits: torch.Tensor, request_ids: list[str], masks: StepMasks | None = None
    ) -> LaunchedStep:
        """Sample on the device; each sampled request's list gets a placeholder until `collect`.
        masks: the step's guided masks being computed (`_masks_beside_the_forward`); requests
        whose masks are late are sampled unmasked and their tokens dropped (`LaunchedStep.deferred`).

        num_computed_tokens is not advanced here: the next SchedulerOutput carries it.
        """
        if not request_ids:
            return LaunchedStep([])
        rows = [self._sampling_row(self.requests[r]) for r in request_ids]
        late: set[str] = set()
        if masks is not None:
            bits, late = masks.gather(_done_marker(logits), self.late_mask_grace_s, self._launched_at)
            mask = token_mask(bits, logits.device)
        else:
            mask = self.guided.mask(request_ids, logits) if len(self.guided) else None
        sampled = self.sampler(logits, rows, mask)
        step = LaunchedStep(request_ids, sampled.token_ids, logprob_rows=sampled.logprob_rows, deferred=late)
        step.logprobs = sampled.logprob_tensors
        for request_id in request_ids:
            token_ids = self.requests[request_id].token_ids
            step.placeholder_index.append(len(token_ids))
            if request_id not in late:
                token_ids.append(PLACEHOLDER)
        return step

    @staticmethod
    def _sampling_row(state: RunnerRequestState) -> SamplingRow:
        step = len(state.token_ids) - state.num_prompt_tokens
        if not state.params.needs_penalties:  # only penalties read the tokens: copy none
            return SamplingRow(state.params, [], [], step)
        prompt = state.token_ids[: state.num_prompt_tokens]
        output = state.token_ids[state.num_prompt_tokens :]
        return SamplingRow(state.params, prompt, output, step)


def _done_marker(logits: torch.Tensor) -> Callable[[], bool]:
    """Whether the device has computed `logits` yet, asked without waiting (on the CPU it has)."""
    if logits.device.type != "cuda":
        return lambda: True
    done = torch.cuda.Event()
    done.record()
    return done.query
