"""OpenAI's request shapes (with vLLM's common extensions) and their translation into a `SamplingRequest`."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tgserve.router.config import RouterConfig
from tgserve.router.errors import ValidationError
from tgserve.router.guided import ResponseFormat, response_format_guided
from tgserve.router.schema_rules import (
    MAX_BEST_OF,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_TOP_N_TOKENS,
    flag_bound,
    logit_biases,
    non_empty_prompt,
    non_empty_stop,
    number_bounds,
    token_id_lists,
    tools_for_tool_choice,
    top_logprobs_with_logprobs,
    whole,
)
from tgserve.router.tools import Tool, ToolCalling, ToolChoice, tool_calling
from tgserve.router.validation import MAX_SEED, MAX_TOP_K, MIN_SEED, SamplingRequest, sampling_params
from tgserve.server.protocol.params import GuidedDecoding

# Unknown fields are ignored (OpenAI clients send many); known ones are type-checked strictly.
STRICT = ConfigDict(extra="ignore", strict=True)


def _nulls_allowed(schema: dict[str, Any]) -> None:
    """/openapi.json says what the server takes: null for any optional field, meaning "not given"
    (`_null_means_not_given`; a required one must be given)."""
    required = set(schema.get("required", ()))
    for name, field_schema in schema.get("properties", {}).items():
        if name in required:
            continue
        variants = field_schema.get("anyOf", [field_schema])
        if not any(variant.get("type") == "null" for variant in variants):
            schema["properties"][name] = {"anyOf": [field_schema, {"type": "null"}]}


class OpenAIRequest(BaseModel):
    """OpenAI's schema lets its optional fields be null, meaning "not given": clients that forward
    optional arguments send `"n": null`, `"logprobs": null`. Such a field takes its default."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_nulls_allowed)

    @model_validator(mode="before")
    @classmethod
    def _null_means_not_given(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class SamplingFields(OpenAIRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: whole(ge=1) = Field(default=1, json_schema_extra=flag_bound(MAX_N))
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, json_schema_extra=non_empty_stop)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra=logit_biases)
    seed: whole() | None = Field(
        default=None, json_schema_extra=number_bounds(minimum=MIN_SEED, maximum=MAX_SEED)
    )
    user: str | None = None
    # vLLM's extensions, used by its benchmark client among others.
    top_k: whole(ge=-1) | None = Field(default=None, json_schema_extra=number_bounds(maximum=MAX_TOP_K))
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[whole()] | None = Field(default=None, json_schema_extra=token_id_lists)
    # Structured output; on /v1/completions too, as vLLM takes it.
    response_format: ResponseFormat | None = None


# Insertion is not served: a suffix, if given, is empty (the schema says so; a request with one is a 400).
NO_SUFFIX: dict[str, Any] = {"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[whole()] | list[list[whole()]] = Field(json_schema_extra=non_empty_prompt)
    max_tokens: whole(ge=1) | None = Field(default=16, json_schema_extra=flag_bound(MAX_NEW_TOKENS))
    logprobs: whole(ge=0) | None = Field(default=None, json_schema_extra=flag_bound(MAX_TOP_N_TOKENS))
    echo: bool = False
    best_of: whole(ge=1) | None = Field(default=None, json_schema_extra=flag_bound(MAX_BEST_OF))
    suffix: str | None = Field(default=None, json_schema_extra=NO_SUFFIX)


class TextPart(BaseModel):
    """A part of a message's content: text only (`message_text` refuses other parts by name; the
    schema says what is taken)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"required": ["type", "text"]})

    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "string"}]})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


def _chat_rules(schema: dict[str, Any]) -> None:
    _nulls_allowed(schema)
    tools_for_tool_choice(schema)
    top_logprobs_with_logprobs(schema)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_chat_rules)

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: whole(ge=1) | None = Field(default=None, json_schema_extra=flag_bound(MAX_NEW_TOKENS))
    max_completion_tokens: whole(ge=1) | None = Field(
        default=None, json_schema_extra=flag_bound(MAX_NEW_TOKENS)
    )
    logprobs: bool = False
    top_logprobs: whole(ge=0, le=20) | None = Field(
        default=None, json_schema_extra=flag_bound(MAX_TOP_N_TOKENS)
    )
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI keys token ids as strings (in decimal, as /openapi.json states: not " 5", "+5" or
    "05") and bounds each bias to [-100, 100]."""
    result: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not re.fullmatch("0|[1-9][0-9]*", key):
            raise ValidationError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        token_id = int(key)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValidationError(
                f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias"
            )
        result[token_id] = value
    return result


def openai_sampling(
    request: SamplingFields,
    config: RouterConfig,
    max_tokens: int | None,
    logprobs: int | None,
    n: int,
    prompt_logprobs: int | None = None,
    guided: GuidedDecoding | None = None,
) -> SamplingRequest:
    """Translate the shared fields; `n` here is the number of engine requests per prompt. guided:
    what the reply must follow when not `response_format` (a tool call's grammar)."""
    if n > config.max_n:
        raise ValidationError(f"n is {n}, more than the server's limit of {config.max_n}", param="n")
    temperature = 1.0 if request.temperature is None else request.temperature
    params = sampling_params(
        temperature=temperature,
        top_k=max(0, request.top_k or 0),  # vLLM's -1 means "off", like 0
        top_p=1.0 if request.top_p is None else request.top_p,
        min_p=request.min_p or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        seed=request.seed,
        stop=stop_strings(request.stop),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias(request.logit_bias),
        guided=guided or response_format_guided(request.response_format),
    )
    return SamplingRequest(params, max_tokens, n)


def chat_sampling(
    request: ChatCompletionRequest, config: RouterConfig, calling: ToolCalling | None
) -> SamplingRequest:
    """How a chat request samples (calling: its tool calling, `chat_tool_calling`); the limits
    that depend on its prompt are `build_spec`'s."""
    max_tokens = request.max_completion_tokens or request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    if request.top_logprobs and not request.logprobs:
        raise ValidationError("top_logprobs needs logprobs=true", param="top_logprobs")
    guided = None if calling is None else calling.guided()
    return openai_sampling(request, config, max_tokens, logprobs, request.n, guided=guided)


def message_text(message: ChatMessage) -> str:
    """Text content only: this server serves text models."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ValidationError(f"message content of type {part.type!r} is not supported", param="messages")
        texts.append(part.text)
    return "".join(texts)


def chat_tool_calling(request: ChatCompletionRequest) -> ToolCalling | None:
    """The function calling a chat request asks for (`tools.py`); None for a plain-text reply."""
    calling = tool_calling(request.tools, request.tool_choice, request.parallel_tool_calls)
    if calling is not None and request.response_format is not None and request.response_format.type != "text":
        raise ValidationError(
            "response_format cannot be combined with tools: a reply that may call them follows their own "
            "format (set tool_choice to 'none' for a response_format reply)",
            param="response_format",
        )
    return calling


def chat_template_inputs(
    request: ChatCompletionRequest, calling: ToolCalling | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the chat template takes them. Messages: earlier tool calls with their
    arguments as objects (as transformers' templates read them), tool results with their call's id,
    and, when the reply may call functions (`calling`, `chat_tool_calling`), the instruction that
    shows them (`tools.py`). Tools: the request's, when the reply may call them."""
    messages = [_template_message(message) for message in request.messages]
    if calling is None:
        return messages, None
    if messages[0]["role"] in ("system", "developer"):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{calling.instruction()}".lstrip()
    else:
        messages.insert(0, {"role": "system", "content": calling.instruction()})
    return messages, [tool.model_dump(exclude_none=True) for tool in request.tools or []]


def _template_message(message: ChatMessage) -> dict[str, Any]:
    item: dict[str, Any] = {"role": message.role, "content": message_text(message)}
    if message.name:
        item["name"] = message.name
    extra = message.model_extra or {}
    if message.role == "tool" and isinstance(extra.get("tool_call_id"), str):
        item["tool_call_id"] = extra["tool_call_id"]
    if message.role == "assistant" and extra.get("tool_calls"):
        item["tool_calls"] = [_template_call(call) for call in extra["tool_calls"]]
    return item


def _template_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValidationError("an assistant message's tool_calls need function.name", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise ValidationError(
                f"the arguments of the earlier call to {function['name']!r} are not JSON", param="messages"
            ) from exc
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
