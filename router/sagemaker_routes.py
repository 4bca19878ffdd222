"""SageMaker's inference route, as TGI serves it: POST /invocations takes any of the generation
bodies and answers as the route that body belongs to (SageMaker's liveness probe, /ping, is a
service route)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Message

from tgserve.router import openai_routes, tgi_routes
from tgserve.router.http import json_object, read_body
from tgserve.router.state import router_state

router = APIRouter()


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    """`messages`: a chat completion; `prompt`: a completion; else TGI's `inputs` (as POST /)."""
    body = await read_body(request, router_state(request).config.payload_limit)
    again = replaying(request, body)
    shape = json_object(body)
    if "messages" in shape:
        return await openai_routes.chat_completions(again)
    if "prompt" in shape:
        return await openai_routes.completions(again)
    return await tgi_routes.compat_generate_route(again)


def replaying(request: Request, body: bytes) -> Request:
    """The request again with its body already read: the body first, then the client's own messages
    (a disconnect, which the routes watch for)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)
