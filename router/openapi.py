"""The request bodies in /openapi.json (and so in /docs).

The routes read and validate their bodies themselves (a bounded read, then strict pydantic parsing
whose errors name the field), so FastAPI does not see their models. Each route's model is added to
the schema FastAPI generates, with the models it refers to under `components/schemas`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tgserve.router.openai_schemas import ChatCompletionRequest, CompletionRequest
from tgserve.router.service_routes import DetokenizeRequest
from tgserve.router.tgi_schemas import TGIRequest

REF = "#/components/schemas/{model}"

# path -> the body it takes (POST); /tokenize and /invocations take several shapes and stay open.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": TGIRequest,
    "/generate_stream": TGIRequest,
    "/": TGIRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/chat_tokenize": ChatCompletionRequest,
    "/detokenize": DetokenizeRequest,
}


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with one that documents the request bodies (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_request_bodies(
                get_openapi(title=app.title, version=app.version, routes=app.routes)
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def with_request_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        operation = schema.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        body = model.model_json_schema(ref_template=REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    return schema
