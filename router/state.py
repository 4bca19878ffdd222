"""What every route needs, gathered once when the app is built, and the shared request entry point."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from tgserve.router.config import RouterConfig
from tgserve.router.engine_client import EngineClient
from tgserve.router.errors import RouterError
from tgserve.router.generation import Generation, Generator
from tgserve.router.http import read_body
from tgserve.router.metrics import RouterMetrics
from tgserve.router.tokenization import RouterTokenizer
from tgserve.router.validation import GenerationSpec
from tgserve.server.protocol.messages import EngineReady


@dataclass
class RouterState:
    """The app's shared objects; `request.app.state.router` holds one."""

    config: RouterConfig
    client: EngineClient
    tokenizer: RouterTokenizer
    metrics: RouterMetrics
    generator: Generator
    engine: EngineReady
    model_name: str  # what /v1/models and responses call the model
    model_dtype: str = ""
    started_at: float = 0.0

    def __post_init__(self) -> None:
        self.started_at = time.time()


def router_state(request: Request) -> RouterState:
    return request.app.state.router


async def start_generation(request: Request, build: Callable[[bytes], list[GenerationSpec]]) -> Generation:
    """Count, read, validate (via `build`), admit and submit one generation request.

    Every failure before the engine has the request is counted in `tgi_request_failure{err}` and
    re-raised for the route's error shape.
    """
    state = router_state(request)
    state.metrics.request_count.inc()
    started = time.monotonic()
    try:
        body = await read_body(request, state.config.payload_limit)
        specs = build(body)
        return state.generator.start(specs, time.monotonic() - started)
    except RouterError as exc:
        state.metrics.request_failure.labels(err=exc.kind).inc()
        raise
