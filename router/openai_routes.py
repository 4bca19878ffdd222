"""OpenAI's routes: GET /v1/models, POST /v1/completions and /v1/chat/completions (JSON or SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tgserve.router import openai_format as fmt
from tgserve.router.errors import RouterError, ValidationError
from tgserve.router.generation import Generation
from tgserve.router.http import EventStreamResponse, parse_json, sse, until_disconnected
from tgserve.router.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_sampling,
    chat_template_inputs,
    chat_tool_calling,
    openai_sampling,
)
from tgserve.router.state import RouterState, router_state, start_generation
from tgserve.router.tool_stream import ToolCallStream
from tgserve.router.tools import read_reply
from tgserve.router.validation import GenerationSpec, build_spec

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = router_state(request)
    model = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "tgserve",
        "max_model_len": state.config.total_limit,
    }
    return {"object": "list", "data": [model]}


# ---- /v1/completions -------------------------------------------------------------------------


def completion_prompts(state: RouterState, prompt: Any) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        return [state.tokenizer.encode(prompt)]
    if not prompt:
        raise ValidationError("`prompt` is an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [state.tokenizer.encode(p) for p in prompt]
    return [list(p) for p in prompt]


def completion_specs(state: RouterState, request: CompletionRequest) -> list[GenerationSpec]:
    if request.suffix:
        raise ValidationError("`suffix` (insertion) is not supported by this server", param="suffix")
    prompts = completion_prompts(state, request.prompt)
    if len(prompts) > state.config.max_client_batch_size:
        raise ValidationError(
            f"{len(prompts)} prompts given, more than --max-client-batch-size={state.config.max_client_batch_size}",
            param="prompt",
        )
    best_of = request.best_of or request.n
    if best_of < request.n:
        raise ValidationError(f"best_of ({best_of}) must be >= n ({request.n})", param="best_of")
    if request.best_of is not None and best_of > state.config.max_best_of:  # even best_of == n: as stated
        raise ValidationError(
            f"best_of is {best_of}, more than --max-best-of={state.config.max_best_of}", param="best_of"
        )
    if best_of > request.n and request.stream:
        raise ValidationError("best_of > n cannot be used with stream", param="best_of")
    # best_of ranks sequences by log-probability, so it needs them even when the client does not.
    logprobs = request.logprobs if request.logprobs is not None else (0 if best_of > request.n else None)
    # Echoed prompt tokens carry their log-probabilities too.
    prompt_logprobs = request.logprobs if request.echo else None
    sampling = openai_sampling(request, state.config, request.max_tokens, logprobs, best_of, prompt_logprobs)
    return [build_spec(state.config, state.tokenizer, ids, sampling, include_stop=False) for ids in prompts]


def completion_body(state: RouterState, request: CompletionRequest, generation: Generation) -> dict[str, Any]:
    body = fmt.envelope("text_completion", fmt.new_id("cmpl"), state.model_name)
    choices = []
    for prompt_index, spec in enumerate(generation.specs):
        prefix = state.tokenizer.decode(spec.prompt_token_ids) if request.echo else ""
        for seq_index, seq in enumerate(fmt.best_sequences(generation, prompt_index, request.n)):
            logprobs = None
            if request.logprobs is not None:
                echoed = spec.prompt_token_ids if request.echo else None
                scored = generation.prompt_logprobs(prompt_index) if request.echo else None
                logprobs = fmt.completion_logprobs(state.tokenizer, seq.tokens, 0, echoed, scored)
            index = prompt_index * request.n + seq_index
            choices.append(fmt.completion_choice(index, prefix + seq.text, logprobs, seq.finish_reason))
    body["choices"] = choices
    body["usage"] = fmt.usage(generation)
    return body


async def completion_events(
    state: RouterState, request: CompletionRequest, generation: Generation
) -> AsyncIterator[bytes]:
    head = fmt.envelope("text_completion", fmt.new_id("cmpl"), state.model_name)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    offsets: dict[int, int] = {}  # choice index -> text offset so far
    try:
        async for prompt_index, delta in generation.deltas():
            index = prompt_index * request.n + delta.index
            text = delta.text
            echoed = request.echo and index not in offsets
            if echoed:
                text = state.tokenizer.decode(generation.specs[prompt_index].prompt_token_ids) + text
            offset = offsets.get(index, 0)
            offsets[index] = offset + len(text)
            logprobs = None
            if request.logprobs is not None and (echoed or delta.tokens):
                prompt_ids = generation.specs[prompt_index].prompt_token_ids if echoed else None
                scored = generation.prompt_logprobs(prompt_index) if echoed else None
                logprobs = fmt.completion_logprobs(state.tokenizer, delta.tokens, offset, prompt_ids, scored)
            if not text and logprobs is None and delta.finish_reason is None:
                continue
            chunk = {**head, "choices": [fmt.completion_choice(index, text, logprobs, delta.finish_reason)]}
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": fmt.usage(generation)})
    except RouterError as exc:
        yield sse(exc.openai_body())
    yield sse("[DONE]")


async def serve_generation(request: Request, schema: type, specs, events, body) -> Response:
    """Parse the body as `schema`, start the generation, answer as a stream or one JSON body.

    specs(state, parsed) -> GenerationSpecs; events(state, parsed, generation) -> SSE bytes;
    body(state, parsed, generation) -> the JSON response.
    """
    state = router_state(request)
    parsed: list[Any] = []

    def build(raw: bytes) -> list[GenerationSpec]:
        parsed.append(parse_json(schema, raw))
        return specs(state, parsed[0])

    generation = await start_generation(request, build)
    if parsed[0].stream:
        return EventStreamResponse(events(state, parsed[0], generation), generation.close)
    await until_disconnected(request, state.generator.run(generation))
    return JSONResponse(body(state, parsed[0], generation))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await serve_generation(
        request, CompletionRequest, completion_specs, completion_events, completion_body
    )


# ---- /v1/chat/completions --------------------------------------------------------------------


def chat_specs(state: RouterState, request: ChatCompletionRequest) -> list[GenerationSpec]:
    calling = chat_tool_calling(request)
    prompt_ids = state.tokenizer.encode_chat(*chat_template_inputs(request, calling))
    sampling = chat_sampling(request, state.config, calling)
    return [build_spec(state.config, state.tokenizer, prompt_ids, sampling, include_stop=False)]


def chat_body(state: RouterState, request: ChatCompletionRequest, generation: Generation) -> dict[str, Any]:
    body = fmt.envelope("chat.completion", fmt.new_id("chatcmpl"), state.model_name)
    calls = chat_tool_calling(request) is not None
    choices = []
    for seq in generation.sequences:
        logprobs = fmt.chat_logprobs(state.tokenizer, seq.tokens) if request.logprobs else None
        if calls:
            reply = read_reply(seq.text)
            choices.append(
                fmt.chat_choice(seq.index, reply.content, logprobs, seq.finish_reason, reply.tool_calls)
            )
        else:
            choices.append(fmt.chat_choice(seq.index, seq.text, logprobs, seq.finish_reason))
    body["choices"] = choices
    body["usage"] = fmt.usage(generation)
    return body


async def chat_events(
    state: RouterState, request: ChatCompletionRequest, generation: Generation
) -> AsyncIterator[bytes]:
    head = fmt.envelope("chat.completion.chunk", fmt.new_id("chatcmpl"), state.model_name)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]]) -> bytes:
        return sse({**head, "choices": choices, **({"usage": None} if include_usage else {})})

    try:
        # The role comes first, once per choice, as OpenAI sends it.
        for seq in generation.sequences:
            yield chunk([fmt.chat_chunk_choice(seq.index, {"role": "assistant", "content": ""}, None, None)])
        if chat_tool_calling(request) is not None:
            async for choice in tool_call_choices(state, request, generation):
                yield chunk([choice])
            if include_usage:
                yield sse({**head, "choices": [], "usage": fmt.usage(generation)})
            yield sse("[DONE]")
            return
        async for _, delta in generation.deltas():
            logprobs = None
            if request.logprobs and delta.tokens:
                logprobs = fmt.chat_logprobs(state.tokenizer, delta.tokens)
            if not delta.text and logprobs is None and delta.finish_reason is None:
                continue
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            yield chunk([fmt.chat_chunk_choice(delta.index, content, logprobs, delta.finish_reason)])
        if include_usage:
            yield sse({**head, "choices": [], "usage": fmt.usage(generation)})
    except RouterError as exc:
        yield sse(exc.openai_body())
    yield sse("[DONE]")


async def tool_call_choices(
    state: RouterState, request: ChatCompletionRequest, generation: Generation
) -> AsyncIterator[dict[str, Any]]:
    """A reply that may call functions, streamed as OpenAI streams one: each call's id and name once
    the name is complete, then its arguments' text as it grows; or a plain answer's text as it grows
    (`tool_stream.py`). The JSON around them is never sent."""
    replies: dict[int, ToolCallStream] = {}
    async for _, delta in generation.deltas():
        reply = replies.setdefault(delta.index, ToolCallStream())
        piece = reply.add(delta.text)
        logprobs = None
        if request.logprobs and delta.tokens:
            logprobs = fmt.chat_logprobs(state.tokenizer, delta.tokens)
        reason = delta.finish_reason
        if reason is not None:
            piece = {**piece, **reply.finish()}
            reason = fmt.tool_calls_reason(reason) if reply.calls_sent else reason
        if piece or logprobs is not None or reason is not None:
            yield fmt.chat_chunk_choice(delta.index, piece, logprobs, reason)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await serve_generation(request, ChatCompletionRequest, chat_specs, chat_events, chat_body)
