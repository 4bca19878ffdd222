"""The request bodies and the responses in /openapi.json (and so in /docs).

The routes read and validate their bodies themselves (a bounded read, then strict pydantic parsing
whose errors name the field), so FastAPI does not see their models. Each route's model is added to
the schema FastAPI generates, with the models it refers to under `components/schemas`; so are the
errors each route answers (in its family's shape, `errors.py`), the streams it may send, and the
bodies that are not JSON (the probes' empty 200, Prometheus text), so that a client, or a fuzzer
checking every response against the schema, is told what comes back.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tgserve.router.errors import error_status, is_openai_path
from tgserve.router.openai_schemas import ChatCompletionRequest, CompletionRequest
from tgserve.router.schema_rules import TGI_STREAM_PARAMETERS, fill_bounds
from tgserve.router.service_routes import DetokenizeRequest, VLLMTokenizeRequest
from tgserve.router.tgi_schemas import TGIRequest, TGITokenizeRequest

REF = "#/components/schemas/{model}"

# path -> the body it takes (POST).
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": TGIRequest,
    "/generate_stream": TGIRequest,
    "/": TGIRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/chat_tokenize": ChatCompletionRequest,
    "/detokenize": DetokenizeRequest,
}


# Routes that stream server-sent events when asked (TGI's always).
STREAMING = ("/generate_stream", "/v1/completions", "/v1/chat/completions", "/", "/invocations")
# Probes answer an empty 200 (and their error as JSON); /metrics answers Prometheus' text format.
EMPTY_OK = ("/health", "/ping", "/")
TEXT_OK = {"/metrics": "text/plain"}

TGI_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
    "required": ["error", "error_type"],
}
OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
            "required": ["message", "type", "code"],
        }
    },
    "required": ["error"],
}


def install_openapi(app: FastAPI, maximums: dict[str, int]) -> None:
    """Replace `app.openapi` with one that documents the request bodies and responses, the bounds
    that the served model and the flags set filled in ({schema_rules mark: maximum}; built once,
    then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema = with_responses(with_request_bodies(schema))
            fill_bounds(schema, maximums)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# Routes whose JSON body takes one of several shapes, told apart by a key: TGI's or vLLM's /tokenize
# (`inputs`; `prompt` or `messages`), SageMaker's /invocations (`messages`, `prompt`, else `inputs`).
SHAPED_BODIES: dict[str, list[dict[str, Any]]] = {
    "/tokenize": [
        {"$ref": REF.format(model="TGITokenizeRequest")},
        {"allOf": [{"$ref": REF.format(model="VLLMTokenizeRequest")}], "required": ["prompt"],
         "properties": {"prompt": {"type": "string"}}},
        {"allOf": [{"$ref": REF.format(model="VLLMTokenizeRequest")}], "required": ["messages"],
         "properties": {"messages": {"type": "array"}}},
    ],
    "/invocations": [
        {"$ref": REF.format(model="ChatCompletionRequest")},
        {"$ref": REF.format(model="CompletionRequest")},
        {"$ref": REF.format(model="TGIRequest")},
    ],
}  # fmt: skip
SHAPE_MODELS = (TGITokenizeRequest, VLLMTokenizeRequest)  # components the shapes name beside REQUEST_BODIES


def with_request_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in SHAPE_MODELS:
        body = model.model_json_schema(ref_template=REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    for path, shapes in SHAPED_BODIES.items():
        if (operation := schema.get("paths", {}).get(path, {}).get("post")) is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"anyOf": shapes}}},
            }
    for path, model in REQUEST_BODIES.items():
        operation = schema.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        body = model.model_json_schema(ref_template=REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        body_schema: dict[str, Any] = {"$ref": REF.format(model=model.__name__)}
        if path == "/generate_stream":  # TGI's request, always streamed
            body_schema = {"allOf": [body_schema], "properties": {"parameters": TGI_STREAM_PARAMETERS}}
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body_schema}},
        }
    return schema


# One server-sent event of a stream (as schema checkers read a text/event-stream body): its `data`
# is one JSON chunk, or OpenAI's closing `[DONE]`.
SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def with_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """Every operation's error statuses in its family's shape, its streams and non-JSON bodies."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["TGIError"], components["OpenAIError"] = TGI_ERROR, OPENAI_ERROR
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's own validation error: the routes validate themselves
            ok = responses.setdefault("200", {"description": "Successful Response"})
            if path in EMPTY_OK and method == "get":
                ok.pop("content", None)  # an empty body, no media type
            elif path in TEXT_OK:
                ok["content"] = {TEXT_OK[path]: {"schema": {"type": "string"}}}
            elif path in STREAMING and method == "post":
                ok.setdefault("content", {"application/json": {"schema": {}}})
                ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
            responses.update(_errors(path, method))
    return schema


def _errors(path: str, method: str) -> dict[str, Any]:
    """The statuses a route may answer with an error body: any route may be unauthorized,
    overloaded or find the engine gone; a body may also be refused (too large, not JSON, invalid)."""
    openai = is_openai_path(path)
    kinds = ["unauthorized", "overloaded", "unavailable"]
    if method == "post":
        kinds += ["validation", "payload_too_large", "unsupported_media_type", "generation"]
    body = {"$ref": REF.format(model="OpenAIError" if openai else "TGIError")}
    out = {}
    for kind in kinds:
        out[str(error_status(kind, openai))] = {
            "description": kind.replace("_", " "),
            "content": {"application/json": {"schema": body}},
        }
    return out
