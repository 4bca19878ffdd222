"""Routes around generation: /health, /ping, /info, /metrics, and /tokenize, /detokenize
(TGI's shape for `{"inputs": ...}`, vLLM's for `{"prompt"|"messages": ...}`, so `vllm bench serve` works)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

import tgserve
from tgserve.router.errors import EngineUnavailableError, ValidationError
from tgserve.router.http import json_object, parse_json, read_body
from tgserve.router.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    chat_sampling,
    chat_template_inputs,
    chat_tool_calling,
    message_text,
)
from tgserve.router.schema_rules import token_id_lists, whole
from tgserve.router.state import router_state
from tgserve.router.tgi_schemas import TGITokenizeRequest
from tgserve.router.validation import check_fields, check_token_ids

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 only when the engine loop answers a ping; 503 otherwise (dead, or stuck)."""
    state = router_state(request)
    if await state.client.ping(state.config.health_timeout_s):
        return Response(status_code=200)
    reason = state.client.dead_reason or "the engine did not answer in time"
    return EngineUnavailableError(f"unhealthy: {reason}").response(openai=False)


@router.get("/ping")
@router.get("/")
async def ping(request: Request) -> Response:
    """SageMaker's liveness probe and the Inference API's (GET /), answered like /health, as TGI does."""
    return await health(request)


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    state = router_state(request)
    config = state.config
    return {
        "model_id": state.engine.model_id,
        "model_sha": None,
        "model_dtype": state.engine.dtype or None,
        "model_device_type": state.engine.device or None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": config.max_concurrent_requests,
        "max_best_of": config.max_best_of,
        "max_stop_sequences": config.max_stop_sequences,
        "max_input_tokens": config.input_limit,
        "max_total_tokens": config.total_limit,
        # What the KV cache stores and the longest context it serves (the pool may hold less than
        # the model's length): both depend on --kv-cache-dtype.
        "kv_cache_dtype": state.engine.kv_cache_dtype or None,
        "max_servable_tokens": state.engine.max_servable_tokens or state.engine.max_model_len,
        "max_client_batch_size": config.max_client_batch_size,
        "validation_workers": 1,
        "router": "tgserve",
        "version": tgserve.__version__,
        "sha": None,
        "docker_label": None,
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = router_state(request).metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


class VLLMTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[whole()] = Field(max_length=1_000_000, json_schema_extra=token_id_lists)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = router_state(request)
    body = await read_body(request, state.config.payload_limit)
    if "inputs" in json_object(body):
        tgi_request = parse_json(TGITokenizeRequest, body)
        return JSONResponse(simple_tokens(state, tgi_request.inputs, add_special_tokens=True))
    vllm_request = parse_json(VLLMTokenizeRequest, body)
    ids = vllm_tokens(state, vllm_request)
    return JSONResponse({"count": len(ids), "max_model_len": state.config.total_limit, "tokens": ids})


def simple_tokens(state: Any, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
    """TGI's tokens: id, text, and character offsets into `text`."""
    return [
        {"id": i, "text": text[start:stop], "start": start, "stop": stop}
        for i, start, stop in state.tokenizer.offsets(text, add_special_tokens)
    ]


@router.post("/chat_tokenize")
async def chat_tokenize(request: Request) -> Response:
    """TGI's: a chat request's prompt as /v1/chat/completions renders it, and its tokens."""
    state = router_state(request)
    chat = parse_json(ChatCompletionRequest, await read_body(request, state.config.payload_limit))
    calling = chat_tool_calling(chat)
    # Its sampling fields are checked as the chat route checks them: a body it refuses is refused here.
    sampling = chat_sampling(chat, state.config, calling)
    check_fields(state.config, sampling)
    check_token_ids(state.tokenizer, sampling.params)
    messages, tools = chat_template_inputs(chat, calling)
    text = state.tokenizer.chat_prompt(messages, tools=tools)
    # The template writes the special tokens it wants; the chat route adds none.
    return JSONResponse(
        {"tokenize_response": simple_tokens(state, text, add_special_tokens=False), "templated_text": text}
    )


def vllm_tokens(state: Any, request: VLLMTokenizeRequest) -> list[int]:
    if request.messages is not None:
        messages = [{"role": m.role, "content": message_text(m)} for m in request.messages]
        text = state.tokenizer.chat_prompt(messages, add_generation_prompt=request.add_generation_prompt)
        return state.tokenizer.encode(text, add_special_tokens=False)
    if request.prompt is None:
        raise ValidationError("give `inputs` (TGI), `prompt` or `messages` (vLLM)", param="prompt")
    return state.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state = router_state(request)
    parsed = parse_json(DetokenizeRequest, await read_body(request, state.config.payload_limit))
    state.tokenizer.check_ids(parsed.tokens, "tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(parsed.tokens, skip_special_tokens=False)})
