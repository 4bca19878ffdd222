"""The FastAPI application: routes, error shapes, API-key and body-size guards."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import tgserve
from tgserve.router import openai_routes, sagemaker_routes, schema_rules, service_routes, tgi_routes
from tgserve.router.errors import (
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RouterError,
    UnauthorizedError,
    ValidationError,
    is_openai_path,
)
from tgserve.router.http import ClientDisconnected
from tgserve.router.openapi import install_openapi
from tgserve.router.state import RouterState

logger = logging.getLogger("tgserve.router")

# Probes and scrapers do not carry the API key.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
DRAIN_LIMIT = 64 << 20  # the most of a refused body read before answering; past it the connection closes


class GuardMiddleware:
    """Checks the bearer token (constant-time) and refuses a declared body over the payload limit
    before any route reads it. Bodies without Content-Length are bounded again while being read."""

    def __init__(self, app: ASGIApp, api_key: str | None, payload_limit: int):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.payload_limit = payload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        error = self._check(scope["path"], scope["method"], headers)
        if error is None:
            await self.app(scope, receive, send)
            return
        await _drain(receive, DRAIN_LIMIT)
        response = error.response(openai=is_openai_path(scope["path"]))
        if isinstance(error, UnauthorizedError):
            response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _check(self, path: str, method: str, headers: dict[bytes, bytes]) -> RouterError | None:
        if self.expected is not None and path not in OPEN_PATHS and method != "OPTIONS":
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            # The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                reason = "missing" if not given else "wrong"
                return UnauthorizedError(f"API key {reason}: send `Authorization: Bearer <api key>`")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return ValidationError("invalid Content-Length header")
            if int(length) > self.payload_limit:
                return PayloadTooLargeError(
                    f"the request body ({int(length)} bytes) is larger than --payload-limit={self.payload_limit} bytes"
                )
        return None


async def _drain(receive: Receive, limit: int) -> None:
    """Read (and drop) a refused request's body, so the client sees our answer rather than a reset
    connection while it is still sending; past `limit` bytes, stop and let the connection close."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def router_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return exc.response(openai=is_openai_path(request.url.path))


async def unrouted_handler(request: Request, exc: Exception) -> Response:
    """An unknown route or method, in its API's error shape rather than FastAPI's `{"detail": ...}`."""
    assert isinstance(exc, StarletteHTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error_class = {404: NotFoundError, 405: MethodNotAllowedError}.get(exc.status_code)
    if error_class is None:
        return JSONResponse({"error": message}, status_code=exc.status_code, headers=exc.headers)
    response = error_class(message).response(openai=is_openai_path(request.url.path))
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:  # every route of the path (Starlette names only its first route's)
        methods = {m.upper() for m in request.app.openapi().get("paths", {}).get(request.url.path, {})}
        if methods:
            response.headers["allow"] = ", ".join(sorted(methods))
    return response


async def disconnected_handler(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
    error = RouterError(f"internal error: {type(exc).__name__}: {exc}")
    openai = is_openai_path(request.url.path)
    return JSONResponse(error.body(openai), status_code=500)


def create_app(state: RouterState) -> FastAPI:
    """Build the app around a ready `RouterState` (engine connected, tokenizer loaded)."""
    app = FastAPI(title="tgserve", version=tgserve.__version__)
    app.state.router = state
    app.include_router(tgi_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(service_routes.router)
    app.include_router(sagemaker_routes.router)
    install_openapi(
        app,
        {
            schema_rules.TOKEN_ID: state.tokenizer.vocab_size - 1,
            schema_rules.MAX_BEST_OF: state.config.max_best_of,
            schema_rules.MAX_INPUT_TOKENS: state.config.input_limit,
            schema_rules.MAX_TOP_N_TOKENS: state.config.max_top_n_tokens,
            schema_rules.MAX_NEW_TOKENS: state.config.total_limit - 1,
            schema_rules.MAX_N: state.config.max_n,
            schema_rules.MAX_STOP_SEQUENCES: state.config.max_stop_sequences,
            schema_rules.MAX_CLIENT_BATCH: state.config.max_client_batch_size,
        },
    )
    app.add_exception_handler(RouterError, router_error_handler)
    app.add_exception_handler(StarletteHTTPException, unrouted_handler)
    app.add_exception_handler(ClientDisconnected, disconnected_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    if state.config.cors_allow_origin:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.cors_allow_origin),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(
        GuardMiddleware, api_key=state.config.api_key, payload_limit=state.config.payload_limit
    )
    return app
