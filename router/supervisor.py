"""What `tgserve serve` runs: start the engine process, wait until it is ready, serve HTTP, and exit
non-zero when the engine dies (so that a container restarts).

The router process runs one asyncio loop: the ZMQ client, uvicorn, and a watcher of the engine
process. The engine is `python -m tgserve.server.engine.service`, a child that connects back to
the router's ipc:// sockets and exits by itself if the router disappears. An engine that is alive
but silent (stopped, or stuck in one step) for --engine-stall-timeout seconds is killed, and is then
handled as one that died.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import uvicorn

from tgserve.router import serve_args
from tgserve.router.app import create_app
from tgserve.router.config import RouterConfig
from tgserve.router.engine_client import EngineClient
from tgserve.router.generation import Admission, Generator
from tgserve.router.metrics import RouterMetrics
from tgserve.router.state import RouterState
from tgserve.router.tokenization import RouterTokenizer, chat_renderer
from tgserve.server.core.heap import freeze_startup_heap
from tgserve.server.protocol.messages import EngineServiceConfig

logger = logging.getLogger("tgserve.launcher")

WATCH_PERIOD_S = 0.05  # how often the engine process is checked: /health turns 503 well within a second
ERROR_FLUSH_S = 0.3  # after the engine died, time for streams to send their error events before exit
STALL_PING_S = 1.0  # a silent engine's last chance to answer, in case the router's own loop was late
PROGRESS_PERIOD_S = 10.0


def start_engine(args: argparse.Namespace, client: EngineClient, ipc_dir: str) -> subprocess.Popen[bytes]:
    """The engine process; it inherits stdout/stderr, so its download and loading progress bars show.

    It saves its tokenizer into ipc_dir for the router, which reads it without importing torch.
    """
    service_config = EngineServiceConfig(
        input_address=client.input_address,
        output_address=client.output_address,
        engine_args=serve_args.engine_args(args),
        parent_pid=os.getpid(),
        tokenizer_dir=os.path.join(ipc_dir, "tokenizer"),
    )
    command = [
        sys.executable,
        "-m",
        "tgserve.server.engine.service",
        msgspec.json.encode(service_config).decode(),
    ]
    return subprocess.Popen(command, env=serve_args.engine_environment(args))


async def wait_for_engine(client: EngineClient, process: subprocess.Popen[bytes], model: str) -> Any:
    """Wait for the engine's ready message, saying so every few seconds."""
    started = time.monotonic()
    logger.info("starting the engine (pid %d) for %s", process.pid, model)

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_PERIOD_S)
            logger.info("waiting for the engine to load and warm up (%.0fs)", time.monotonic() - started)

    reporter = asyncio.create_task(progress())
    try:
        ready = await client.wait_ready(lambda: process.poll() is None)
    finally:
        reporter.cancel()
    logger.info(
        "engine ready in %.1fs: %s, max_model_len=%d",
        time.monotonic() - started,
        ready.model_id,
        ready.max_model_len,
    )
    return ready


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the caught signal on exit: the launcher must still stop
    the engine process and choose the exit status itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def watch_engine(
    process: subprocess.Popen[bytes], client: EngineClient, server: uvicorn.Server, stall_timeout_s: float
) -> bool:
    """Return True (after failing every request and stopping the server) if the engine process exits,
    or is killed for having stalled."""
    while process.poll() is None:
        await asyncio.sleep(WATCH_PERIOD_S)
        if await engine_stalled(client, stall_timeout_s):
            # A stopped or hung engine never exits by itself: without this, requests would wait for
            # ever and the launcher would never exit for the container to be restarted.
            client.fail(f"the engine loop sent nothing for {stall_timeout_s:g}s and was killed")
            process.kill()
            await asyncio.to_thread(process.wait)
    client.fail(f"the engine process exited with status {process.returncode}")
    await asyncio.sleep(ERROR_FLUSH_S)
    server.should_exit = True
    return True


async def engine_stalled(client: EngineClient, stall_timeout_s: float) -> bool:
    """True when the engine loop, which reports at least every step and every idle heartbeat, has sent
    nothing for stall_timeout_s (0: never checked) and does not answer a ping either."""
    if stall_timeout_s <= 0 or time.monotonic() - client.last_message_at < stall_timeout_s:
        return False
    return not await client.ping(STALL_PING_S)


def build_state(
    args: argparse.Namespace, config: RouterConfig, client: EngineClient, ready: Any
) -> RouterState:
    tokenizer = RouterTokenizer.from_directory(ready.tokenizer_dir)
    tokenizer.warm_up_chat_template()
    resolved = config.resolve(ready.max_model_len, ready.max_servable_tokens or None)
    metrics = RouterMetrics(lambda: (client.stats, ready.block_size))
    generator = Generator(client, tokenizer, metrics, Admission(resolved.max_concurrent_requests))
    return RouterState(
        config=resolved,
        client=client,
        tokenizer=tokenizer,
        metrics=metrics,
        generator=generator,
        engine=ready,
        model_name=resolved.served_model_name or ready.model_id,
    )


async def stop_engine(
    client: EngineClient, process: subprocess.Popen[bytes], timeout_s: float = 10.0
) -> None:
    """Ask the engine to exit; terminate, then kill, if it does not."""
    await client.close()
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bind_http_socket(host: str, port: int) -> socket.socket | None:
    """The HTTP port, bound before the model loads and held until uvicorn listens on it: a taken port
    fails in a second rather than after the load, and nothing started meanwhile (the engine's shard
    workers open ports of their own) can take it. None when it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


async def serve(args: argparse.Namespace, config: RouterConfig, ipc_dir: str) -> int:
    """Run everything; the exit status is 1 if the engine failed or died, else 0."""
    http_socket = bind_http_socket(args.hostname, args.port)
    if http_socket is None:
        logger.error(
            "cannot listen on %s:%d: the address is in use or not available", args.hostname, args.port
        )
        return 1
    with http_socket:
        return await _serve_on(http_socket, args, config, ipc_dir)


async def _serve_on(
    http_socket: socket.socket, args: argparse.Namespace, config: RouterConfig, ipc_dir: str
) -> int:
    client = EngineClient(ipc_dir)
    process = start_engine(args, client, ipc_dir)
    # The chat renderer's import takes most of a second: done while the engine loads.
    renderer = asyncio.create_task(asyncio.to_thread(chat_renderer))
    try:
        ready = await wait_for_engine(client, process, args.model_id or "the default model")
        await renderer
        state = build_state(args, config, client, ready)
    except (RuntimeError, ValueError, OSError, ImportError) as exc:
        logger.error("%s", exc)
        await stop_engine(client, process, timeout_s=2.0)
        return 1
    app = create_app(state)
    freeze_startup_heap("router")
    client.start()
    uvicorn_config = uvicorn.Config(
        app,
        host=args.hostname,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    server = _Server(uvicorn_config)
    watcher = asyncio.create_task(watch_engine(process, client, server, args.engine_stall_timeout))
    try:
        await server.serve(sockets=[http_socket])
    except SystemExit:  # uvicorn exits this way when it cannot start serving
        logger.error("the HTTP server could not start on %s:%d", args.hostname, args.port)
        server.should_exit = True
    engine_died = watcher.done() and not watcher.cancelled()
    watcher.cancel()
    await stop_engine(client, process)
    if engine_died:
        logger.error("exiting: the engine process died (status %s)", process.returncode)
        return 1
    return 0 if server.started else 1
