"""The router's side of the ZMQ link to the engine process.

The router binds both ipc:// sockets and the engine connects, so an engine that dies leaves the router
in charge of cleaning up. One reader task receives every engine message and routes each request's
outputs to that request's queue; sends are non-blocking so that aborts can run from `finally` blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio

from tgserve.router.errors import EngineUnavailableError, GenerationError, RouterError, ValidationError
from tgserve.server.protocol import messages as p
from tgserve.server.protocol.outputs import EngineStats, RequestOutput
from tgserve.server.protocol.params import SamplingParams

logger = logging.getLogger("tgserve.router.engine")

EngineItem = RequestOutput | RouterError  # what a request's queue carries: a delta, or why it ended


class EngineClient:
    """Submit requests, stream their outputs, abort them; knows whether the engine is alive."""

    def __init__(self, ipc_dir: str):
        self.input_address = f"ipc://{os.path.join(ipc_dir, 'engine-input')}"
        self.output_address = f"ipc://{os.path.join(ipc_dir, 'engine-output')}"
        # Sends use a plain socket: a non-blocking send is then an ordinary call, usable anywhere.
        self._sync_context = zmq.Context()
        self._push = self._sync_context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self.input_address)
        self._async_context = zmq.asyncio.Context()
        self._pull = self._async_context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.output_address)
        self._queues: dict[str, asyncio.Queue[EngineItem]] = {}
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._ping_ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self.ready: p.EngineReady | None = None
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self.last_message_at = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------

    async def wait_ready(self, engine_alive: Callable[[], bool], poll_s: float = 0.5) -> p.EngineReady:
        """Wait for `EngineReady` while the engine loads; raise if the engine process exits first."""
        while True:
            if await self._pull.poll(int(poll_s * 1000)):
                message = p.decode_engine_message(await self._pull.recv())
                if isinstance(message, p.EngineReady):
                    self.ready = message
                    self.last_message_at = time.monotonic()
                    return message
                if isinstance(message, p.EngineFailed):
                    raise RuntimeError(f"the engine failed to start: {message.message}")
            elif not engine_alive():
                raise RuntimeError("the engine process exited before it was ready")

    def start(self) -> None:
        """Start routing engine messages; call once, from the serving event loop."""
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        """Ask the engine to exit and release the sockets."""
        self._send(p.Shutdown())
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._pull.close(linger=0)
        self._push.close(linger=0)
        self._async_context.term()
        self._sync_context.term()

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def fail(self, reason: str) -> None:
        """The engine is gone: every in-flight request and ping ends with an error, now."""
        if self.dead_reason is not None:
            return
        logger.error("engine unavailable: %s", reason)
        self.dead_reason = reason
        error = EngineUnavailableError(f"the engine is unavailable: {reason}")
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(error)
        for future in self._pings.values():
            if not future.done():
                future.set_exception(error)

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> asyncio.Queue[EngineItem]:
        """Queue (request_id, prompt ids, params) in the engine; all their outputs arrive on one queue.

        One queue per HTTP request (not per engine request) lets `n` sequences be merged without tasks.
        """
        if self.dead_reason is not None:
            raise EngineUnavailableError(f"the engine is unavailable: {self.dead_reason}")
        queue: asyncio.Queue[EngineItem] = asyncio.Queue()
        for request_id, prompt_token_ids, params in requests:
            self._queues[request_id] = queue
            self._send(p.AddRequest(request_id, prompt_token_ids, params))
        return queue

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests: later messages about them are dropped."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests (the client left): the engine frees their KV blocks."""
        ids = list(request_ids)
        for request_id in ids:
            self._queues.pop(request_id, None)
        if ids:
            self._send(p.AbortRequests(ids))

    def finish(self, request_id: str, reason: str) -> None:
        """The router ended a request itself (a stop string): the engine stops it and frees its blocks."""
        self._queues.pop(request_id, None)
        self._send(p.FinishRequest(request_id, reason))

    async def ping(self, timeout_s: float) -> bool:
        """True when the engine loop answers within timeout_s."""
        if self.dead_reason is not None:
            return False
        ping_id = next(self._ping_ids)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = future
        try:
            self._send(p.Ping(ping_id))
            await asyncio.wait_for(future, timeout_s)
            return True
        except (asyncio.TimeoutError, RouterError):
            return False
        finally:
            self._pings.pop(ping_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- internals ---------------------------------------------------------------------------

    def _send(self, message: p.RouterMessage) -> None:
        try:
            self._push.send(p.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Only possible when no engine is connected, i.e. it is dead; `fail` reports that.
            logger.warning("could not send %s to the engine: %s", type(message).__name__, exc)

    async def _read_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            self.last_message_at = time.monotonic()
            try:
                self._dispatch(p.decode_engine_message(data))
            except Exception:  # noqa: BLE001 - one bad message must not stop the routing of others
                logger.exception("could not handle an engine message")

    def _dispatch(self, message: p.EngineMessage) -> None:
        if isinstance(message, p.StepOutputs):
            if message.stats is not None:
                self.stats = message.stats
            for output in message.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:  # outputs of aborted or router-finished requests are dropped
                    queue.put_nowait(output)
        elif isinstance(message, p.Heartbeat):
            self.stats = message.stats
        elif isinstance(message, p.RequestRejected):
            queue = self._queues.get(message.request_id)
            if queue is not None:
                error_type = ValidationError if message.kind == "validation" else GenerationError
                queue.put_nowait(error_type(message.message))
        elif isinstance(message, p.Pong):
            future = self._pings.get(message.ping_id)
            if future is not None and not future.done():
                future.set_result(None)
        elif isinstance(message, p.EngineFailed):
            self.fail(message.message)
