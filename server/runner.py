"""The model runner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It keeps its own copy of each scheduled request's tokens and blocks (new requests arrive in full,
running ones as diffs) and appends the tokens it samples, as the scheduler does on its side.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from tgserve.server.attention.backend import AttentionBackend
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.core.scheduler_output import SchedulerOutput
from tgserve.server.cuda_graphs import DecodeGraphs
from tgserve.server.forward_context import ForwardContext, forward_context
from tgserve.server.kv_cache import KVCacheSpec
from tgserve.server.outputs import TokenLogprob
from tgserve.server.sampler import Sampler, SamplingRow, token_logprobs
from tgserve.server.sampling_params import SamplingParams
from tgserve.server.transfer import pinned_to, to_device


def padded_block_table(rows: list[list[int]]) -> torch.Tensor:
    """int32 [len(rows), longest row], zero-padded; through numpy, 3x faster than nested lists."""
    lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))
    table = np.zeros((len(rows), int(lengths.max())), dtype=np.int32)
    table[np.arange(table.shape[1])[None, :] < lengths[:, None]] = flat
    return torch.from_numpy(table)


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


@dataclass
class PromptLogprobRows:
    """Which logits rows score which prompt tokens this step (rows after the sampled ones)."""

    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (request, first position, count)
    target_ids: list[int] = field(default_factory=list)
    top_n: list[int] = field(default_factory=list)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    metadata: AttentionMetadata
    sampled_request_ids: list[str]
    prompt_rows: PromptLogprobRows


class ModelRunner:
    """Owns the model, the per-layer KV caches and the sampler for one device."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        specs: list[KVCacheSpec],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.specs = specs
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}
        self.graphs: DecodeGraphs | None = None  # set by the engine on CUDA when graphs are on

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return RunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        if self._fits_graph(inputs):
            meta = inputs.metadata
            logits = self.graphs.run(
                inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens, meta.block_tables
            )
        else:
            logits = self.forward(inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices)
        num_sampled = len(inputs.sampled_request_ids)
        result = self._sample(logits[:num_sampled], inputs.sampled_request_ids)
        result.prompt_logprobs = self._score_prompt(logits[num_sampled:], inputs.prompt_rows)
        return result

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The model over one flat batch, its layers reaching the backend and KV through the context."""
        context = ForwardContext(self.backend, metadata, self.kv_caches, self.specs)
        with forward_context(context):
            return self.model(input_ids, positions, logits_indices)

    def _fits_graph(self, inputs: StepInputs) -> bool:
        """A pure decode step (one token per sequence, each sampled) that a captured graph covers."""
        num_seqs = inputs.metadata.num_seqs
        return (
            self.graphs is not None
            and not inputs.prompt_rows.spans
            and inputs.input_ids.shape[0] == num_seqs == len(inputs.sampled_request_ids)
            and self.graphs.can_run(num_seqs, inputs.metadata.block_tables.shape[1])
        )

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids | out.preempted_request_ids:
            self.requests.pop(request_id, None)
        for new in out.scheduled_new_requests:
            self.requests[new.request_id] = RunnerRequestState(
                list(new.token_ids),
                new.num_prompt_tokens,
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
            )
        for cached in out.scheduled_cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _scheduled_ids(self, out: SchedulerOutput) -> list[str]:
        return [r.request_id for r in out.scheduled_new_requests] + [
            r.request_id for r in out.scheduled_cached_requests
        ]

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, logits_indices, sampled = [0], [], [], []
        prompt_rows, prompt_indices = PromptLogprobRows(), []
        block_rows = []
        bs = self.block_size
        for request_id in self._scheduled_ids(out):
            state = self.requests[request_id]
            start, count = state.num_computed_tokens, out.num_scheduled_tokens[request_id]
            end = start + count
            if count == 1:  # a decoding request: most rows of most steps
                ids.append(state.token_ids[start])
                positions.append(start)
                slots.append(state.block_ids[start // bs] * bs + start % bs)
            else:
                ids.extend(state.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(state.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + count)
            seq_lens.append(end)
            block_rows.append(state.block_ids)
            if end == len(state.token_ids):
                logits_indices.append(query_start_loc[-1] - 1)
                sampled.append(request_id)
            scored_end = min(end, state.num_prompt_tokens - 1)  # position p's logits score token p + 1
            if state.params.prompt_logprobs is not None and start < scored_end:
                prompt_rows.spans.append((request_id, start + 1, scored_end - start))
                prompt_rows.target_ids.extend(state.token_ids[start + 1 : scored_end + 1])
                prompt_rows.top_n.extend([state.params.prompt_logprobs] * (scored_end - start))
                prompt_indices.extend(range(query_start_loc[-2], query_start_loc[-2] + scored_end - start))
        metadata = AttentionMetadata(
            query_start_loc=to_device(query_start_loc, torch.int32, self.device),
            seq_lens=to_device(seq_lens, torch.int32, self.device),
            block_tables=pinned_to(padded_block_table(block_rows), self.device),
            slot_mapping=to_device(slots, torch.int64, self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return StepInputs(
            input_ids=to_device(ids, torch.int64, self.device),
            positions=to_device(positions, torch.int64, self.device),
            logits_indices=to_device(logits_indices + prompt_indices, torch.int64, self.device),
            metadata=metadata,
            sampled_request_ids=sampled,
            prompt_rows=prompt_rows,
        )

    @staticmethod
    def _score_prompt(
        logits: torch.Tensor, rows: PromptLogprobRows
    ) -> dict[str, tuple[int, list[TokenLogprob]]]:
        if not rows.spans:
            return {}
        targets = to_device(rows.target_ids, torch.int64, logits.device)
        scored = token_logprobs(logits, targets, rows.top_n)
        result, offset = {}, 0
        for request_id, first, count in rows.spans:
            result[request_id] = (first, scored[offset : offset + count])
            offset += count
        return result

    def _sample(self, logits: torch.Tensor, request_ids: list[str]) -> RunnerOutput:
        # num_computed_tokens is not advanced here: the next SchedulerOutput carries it.
        if not request_ids:
            return RunnerOutput()
        rows = [self._sampling_row(self.requests[r]) for r in request_ids]
        sampled = self.sampler(logits, rows)
        token_ids = sampled.token_ids.tolist()
        result = RunnerOutput()
        for i, request_id in enumerate(request_ids):
            self.requests[request_id].token_ids.append(token_ids[i])
            result.sampled_token_ids[request_id] = token_ids[i]
            if sampled.logprobs[i] is not None:
                result.logprobs[request_id] = sampled.logprobs[i]
        return result

    @staticmethod
    def _sampling_row(state: RunnerRequestState) -> SamplingRow:
        step = len(state.token_ids) - state.num_prompt_tokens
        if not state.params.needs_penalties:  # only penalties read the tokens: copy none
            return SamplingRow(state.params, [], [], step)
        prompt = state.token_ids[: state.num_prompt_tokens]
        output = state.token_ids[state.num_prompt_tokens :]
        return SamplingRow(state.params, prompt, output, step)
