"""TGI's native routes: POST /generate, /generate_stream and / (JSON or SSE by `stream`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tgserve.router.errors import RouterError
from tgserve.router.generation import Generation, SequenceState, TokenInfo, finite_or_none
from tgserve.router.http import EventStreamResponse, parse_json, sse, until_disconnected
from tgserve.router.state import RouterState, router_state, start_generation
from tgserve.router.tgi_schemas import TGIRequest, tgi_sampling, wants_details
from tgserve.router.validation import GenerationSpec, build_spec
from tgserve.server.protocol.outputs import TokenLogprob

router = APIRouter()


def build_tgi_spec(state: RouterState, request: TGIRequest, stream: bool) -> GenerationSpec:
    """Tokenize (with `truncate` keeping the prompt's end, as TGI does) and validate."""
    sampling = tgi_sampling(request.parameters, state.config, stream)
    prompt_ids = state.tokenizer.encode(request.inputs)
    if request.parameters.truncate is not None:
        prompt_ids = prompt_ids[-request.parameters.truncate :]
    return build_spec(state.config, state.tokenizer, prompt_ids, sampling, include_stop=True)


def token_json(token: TokenInfo) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special}


def top_tokens_json(state: RouterState, token: TokenInfo) -> list[dict[str, Any]]:
    tok = state.tokenizer
    return [
        {"id": i, "text": tok.token_text(i), "logprob": lp, "special": tok.is_special(i)}
        for i, lp in token.top
    ]


def full_text(request: TGIRequest, seq: SequenceState) -> str:
    return request.inputs + seq.text if request.parameters.return_full_text else seq.text


def prefill_json(
    state: RouterState, spec: GenerationSpec, scored: list[TokenLogprob | None] | None
) -> list[dict[str, Any]]:
    """decoder_input_details: each prompt token with its log-probability (null for the first)."""
    scored = scored or [None] * spec.num_prompt_tokens
    return [
        {
            "id": token_id,
            "text": state.tokenizer.token_text(token_id),
            "logprob": None if entry is None else finite_or_none(entry.logprob),
        }
        for token_id, entry in zip(spec.prompt_token_ids, scored, strict=True)
    ]


def sequence_details(
    state: RouterState, seq: SequenceState, prefill: list[dict[str, Any]], top_n_tokens: int | None
) -> dict[str, Any]:
    """TGI's `details` (or one of its `best_of_sequences`, which also carry generated_text)."""
    details: dict[str, Any] = {
        "finish_reason": seq.finish_reason,
        "generated_tokens": len(seq.tokens),
        "seed": seq.params.seed,
        "prefill": prefill,
        "tokens": [token_json(t) for t in seq.tokens],
    }
    if top_n_tokens:
        details["top_tokens"] = [top_tokens_json(state, t) for t in seq.tokens]
    return details


def sequence_score(seq: SequenceState) -> float:
    return sum(t.logprob or 0.0 for t in seq.tokens)


def generate_response(state: RouterState, request: TGIRequest, generation: Generation) -> dict[str, Any]:
    """The non-streaming body: the best sequence (best_of), with details when asked for."""
    spec = generation.specs[0]
    sequences = sorted(generation.sequences, key=sequence_score, reverse=True)
    best = sequences[0]
    body: dict[str, Any] = {"generated_text": full_text(request, best)}
    params = request.parameters
    if wants_details(params):
        prefill = (
            prefill_json(state, spec, generation.prompt_logprobs(0)) if params.decoder_input_details else []
        )
        details = sequence_details(state, best, prefill, params.top_n_tokens)
        if len(sequences) > 1:
            details["best_of_sequences"] = [
                {
                    "generated_text": full_text(request, seq),
                    **sequence_details(state, seq, prefill, params.top_n_tokens),
                }
                for seq in sequences[1:]
            ]
        body["details"] = details
    return body


def compute_type(state: RouterState) -> str:
    """TGI's `x-compute-type`: --compute-type ($COMPUTE_TYPE) where the deployment names it, else
    the engine's device."""
    return state.config.compute_type or state.engine.device or "unknown"


def stream_headers(state: RouterState, request: TGIRequest) -> dict[str, str]:
    """What TGI sends before a stream's first event, when no timing is known yet."""
    return {"x-compute-type": compute_type(state), "x-compute-characters": str(len(request.inputs))}


def response_headers(state: RouterState, request: TGIRequest, generation: Generation) -> dict[str, str]:
    """TGI's headers of a finished /generate: sizes, and its durations (ms, whole; x-compute-time in s)."""
    generated = sum(len(seq.tokens) for seq in generation.sequences)
    headers = {
        **stream_headers(state, request),
        "x-prompt-tokens": str(generation.num_prompt_tokens),
        "x-generated-tokens": str(generated),
    }
    timings = generation.timings
    if timings is None:  # not finished: no durations to report
        return headers
    milliseconds = {
        "x-total-time": timings.total,
        "x-validation-time": timings.validation,
        "x-queue-time": timings.queue,
        "x-inference-time": timings.inference,
        "x-time-per-token": timings.per_token,
    }
    return {
        **headers,
        "x-compute-time": f"{timings.total:.6f}",
        **{name: str(int(seconds * 1000)) for name, seconds in milliseconds.items()},
    }


async def tgi_events(state: RouterState, request: TGIRequest, generation: Generation) -> AsyncIterator[bytes]:
    """One event per token; the last one carries generated_text (and details when asked for)."""
    spec = generation.specs[0]
    params = request.parameters
    try:
        async for _, delta in generation.deltas():
            seq = generation.sequences[delta.index]
            for position, token in enumerate(delta.tokens):
                last = delta.finish_reason is not None and position == len(delta.tokens) - 1
                event: dict[str, Any] = {
                    "index": len(seq.tokens) - len(delta.tokens) + position + 1,
                    "token": token_json(token),
                    "generated_text": full_text(request, seq) if last else None,
                    "details": None,
                }
                if params.top_n_tokens:
                    event["top_tokens"] = top_tokens_json(state, token)
                if last and params.details:
                    event["details"] = {
                        "finish_reason": seq.finish_reason,
                        "generated_tokens": len(seq.tokens),
                        "seed": seq.params.seed,
                        "input_length": spec.num_prompt_tokens,
                    }
                yield sse(event)
    except RouterError as exc:
        yield sse(exc.tgi_body())


async def generate(request: Request, stream: bool | None) -> Response:
    """Shared by the three routes; `stream` None means "as the body says" (POST /)."""
    state = router_state(request)
    parsed: dict[str, TGIRequest] = {}

    def build(body: bytes) -> list[GenerationSpec]:
        tgi_request = parse_json(TGIRequest, body)
        if stream is None and tgi_request.parameters.return_full_text is None:
            # As TGI's POST / answers for text-generation models (the pipeline tag /info reports):
            # the prompt and its continuation, which huggingface_hub's text_generation expects.
            parameters = tgi_request.parameters.model_copy(update={"return_full_text": True})
            tgi_request = tgi_request.model_copy(update={"parameters": parameters})
        parsed["request"] = tgi_request
        return [build_tgi_spec(state, tgi_request, tgi_request.stream if stream is None else stream)]

    generation = await start_generation(request, build)
    tgi_request = parsed["request"]
    if tgi_request.stream if stream is None else stream:
        events = tgi_events(state, tgi_request, generation)
        return EventStreamResponse(events, generation.close, headers=stream_headers(state, tgi_request))
    await until_disconnected(request, state.generator.run(generation))
    body = generate_response(state, tgi_request, generation)
    return JSONResponse(
        [body] if stream is None else body, headers=response_headers(state, tgi_request, generation)
    )


@router.post("/generate")
async def generate_route(request: Request) -> Response:
    return await generate(request, stream=False)


@router.post("/generate_stream")
async def generate_stream_route(request: Request) -> Response:
    return await generate(request, stream=True)


@router.post("/")
async def compat_generate_route(request: Request) -> Response:
    return await generate(request, stream=None)
