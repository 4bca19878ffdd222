"""Errors a request can end with, and how each API family renders them.

Each error has a kind; the TGI routes answer `{"error", "error_type"}` and the OpenAI routes
`{"error": {"message", "type", "param", "code"}}`, with a status code per kind and family.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# kind -> (TGI status, OpenAI status, OpenAI error type)
_KINDS: dict[str, tuple[int, int, str]] = {
    "validation": (422, 400, "invalid_request_error"),
    "unauthorized": (401, 401, "authentication_error"),
    "not_found": (404, 404, "not_found_error"),
    "method_not_allowed": (405, 405, "invalid_request_error"),
    "payload_too_large": (413, 413, "invalid_request_error"),
    "unsupported_media_type": (415, 415, "invalid_request_error"),
    "overloaded": (429, 429, "rate_limit_error"),
    "generation": (424, 500, "server_error"),
    "unavailable": (503, 503, "service_unavailable"),
}


def error_status(kind: str, openai: bool) -> int:
    """The status code an error of `kind` answers with, in the OpenAI family or TGI's."""
    tgi_status, openai_status, _ = _KINDS[kind]
    return openai_status if openai else tgi_status


class RouterError(Exception):
    """A request failure with a message meant for the client. `param` names the offending field."""

    kind = "generation"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def status(self, openai: bool) -> int:
        return error_status(self.kind, openai)

    def tgi_body(self) -> dict[str, Any]:
        return {"error": self.message, "error_type": self.kind}

    def openai_body(self) -> dict[str, Any]:
        _, status, error_type = _KINDS[self.kind]
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": status}}

    def body(self, openai: bool) -> dict[str, Any]:
        return self.openai_body() if openai else self.tgi_body()

    def response(self, openai: bool) -> JSONResponse:
        return JSONResponse(self.body(openai), status_code=self.status(openai))


class ValidationError(RouterError):
    kind = "validation"


class UnauthorizedError(RouterError):
    kind = "unauthorized"


class NotFoundError(RouterError):
    kind = "not_found"


class MethodNotAllowedError(RouterError):
    kind = "method_not_allowed"


class PayloadTooLargeError(RouterError):
    kind = "payload_too_large"


class UnsupportedMediaTypeError(RouterError):
    kind = "unsupported_media_type"


class OverloadedError(RouterError):
    kind = "overloaded"


class GenerationError(RouterError):
    kind = "generation"


class EngineUnavailableError(RouterError):
    """The engine process is gone or does not answer: every in-flight request ends with this."""

    kind = "unavailable"


def is_openai_path(path: str) -> bool:
    """OpenAI- and vLLM-shaped routes answer errors in OpenAI's shape; the rest in TGI's."""
    return path.startswith("/v1/") or path == "/detokenize"
