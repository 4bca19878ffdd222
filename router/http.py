"""HTTP plumbing shared by the routes: bounded body reading, strict JSON parsing, SSE responses that
always clean up, and running a non-streaming generation that stops when the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tgserve.router.errors import PayloadTooLargeError, UnsupportedMediaTypeError, ValidationError

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


def check_json_content_type(request: Request) -> None:
    """Bodies are JSON, and must say so, as TGI and vLLM require. Without this, a web page could post
    to the server from a browser: a `text/plain` or form body needs no CORS preflight."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        sent = f"not {media_type}" if media_type else "and this request has no Content-Type"
        raise UnsupportedMediaTypeError(
            f"the request body must be JSON sent with Content-Type: application/json, {sent}"
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The JSON request body, refusing more than `limit` bytes even without a Content-Length header."""
    check_json_content_type(request)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"the request body is larger than --payload-limit={limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def describe_validation_error(exc: pydantic.ValidationError) -> tuple[str, str | None]:
    """pydantic's errors as one readable message, and the first offending field."""
    parts = []
    first_param = None
    for error in exc.errors(include_url=False):
        location = ".".join(str(item) for item in error["loc"] if item != "body")
        if first_param is None and location:
            first_param = location
        parts.append(f"{location}: {error['msg']}" if location else error["msg"])
    return "; ".join(parts), first_param


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object where it is one, else empty: for routes that take several shapes and
    pick one by its keys (the model they then parse it with names any error)."""
    try:
        shape = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # deep nesting: the model's parse names it
        return {}
    return shape if isinstance(shape, dict) else {}


def parse_json(model: type[ModelT], body: bytes) -> ModelT:
    """Parse and validate a body against a model; any failure is the client's (a 4xx naming it)."""
    if not body:
        raise ValidationError("the request body is empty; a JSON object is expected")
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise ValidationError(message, param=param) from exc


async def parse_request(request: Request, model: type[ModelT], limit: int) -> ModelT:
    return parse_json(model, await read_body(request, limit))


def sse(payload: Any) -> bytes:
    """One server-sent event carrying JSON (or the raw `[DONE]` marker)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n".encode()


class EventStreamResponse(Response):
    """An SSE response that stops when the client disconnects and always runs `on_close`.

    Starlette's StreamingResponse only notices a disconnect at its next write and never closes an
    iterator it did not finish; here a disconnect cancels the stream at once, and `on_close` (which
    aborts the engine requests and frees the admission slot) runs however the response ends, even
    when the iterator was never started.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ):
        # Like StreamingResponse: no `body` attribute, so no Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listener):
                task.cancel()
            await asyncio.gather(stream, listener, return_exceptions=True)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            self.on_close()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            exception = stream.exception()
            if not isinstance(exception, OSError):  # a write to a closed connection is a disconnect
                raise exception

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (its `finally` blocks then abort)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
