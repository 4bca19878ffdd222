"""The offline Python API: `LLM(model).generate(prompts, params)`, run to completion in this process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.factory import create_engine
from tgserve.server.engine.interface import Engine
from tgserve.server.protocol.outputs import RequestOutput, TokenLogprob
from tgserve.server.protocol.params import InvalidRequestError, SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One prompt's result. finish_reason: "length", "eos_token", "stop_sequence" or (guided
    decoding) "grammar_error"."""

    prompt: Prompt
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None first: nothing predicts token 0
    num_cached_tokens: int = 0


class LLM:
    """Load a model (hub id, local directory, .gguf file, or None for the default) and generate offline."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._attach(create_engine(EngineArgs(model=model, **engine_args)))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """Generate offline with an engine already built: anything with `LLMEngine`'s interface, e.g.
        the Gaudi fallback's `StaticBatchEngine`."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids) in one continuous batch; results in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_params_list(params, len(prompt_list))
        results: dict[str, CompletionOutput] = {}
        try:
            for prompt, p in zip(prompt_list, param_list):
                token_ids = self._tokenize(prompt)
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, token_ids, p)
                results[request_id] = CompletionOutput(
                    prompt, token_ids, logprobs=[] if p.logprobs is not None else None
                )
        except InvalidRequestError:
            self.engine.abort_requests(results)  # a bad prompt fails the whole call, leaving nothing queued
            raise
        stops = {rid: p.stop for rid, p in zip(results, param_list)}
        pending = set(results)
        while pending:
            for output in self.engine.step():
                if output.request_id in pending:
                    self._apply(results[output.request_id], output, stops[output.request_id], pending)
        return list(results.values())

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: at least one token is needed")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def _apply(
        self, result: CompletionOutput, output: RequestOutput, stop: tuple[str, ...], pending: set[str]
    ) -> None:
        result.token_ids.extend(output.new_token_ids)
        if output.new_logprobs and result.logprobs is not None:
            result.logprobs.extend(output.new_logprobs)
        result.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            result.prompt_logprobs = output.prompt_logprobs
        if not stop and not output.finished:
            return  # without stop strings the text is needed only once, at the end
        result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        stop_at = _first_stop(result.text, stop)
        if stop_at is not None and not output.finished:
            self.engine.finish_request(output.request_id, "stop_sequence")
        if stop_at is not None:
            result.text = result.text[:stop_at]
            result.finish_reason = "stop_sequence"
            pending.discard(output.request_id)
        elif output.finished:
            result.finish_reason = output.finish_reason
            pending.discard(output.request_id)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    positions = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(positions) if positions else None


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
