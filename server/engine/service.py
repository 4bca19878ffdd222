"""The engine process: a loop around an `Engine` (`LLMEngine`, or the optimum-habana fallback) that
talks to the router over ZMQ.

The loop never waits on the router while it has work: it drains its input socket without blocking,
runs one engine step, pushes that step's outputs, and repeats. Only when the engine is idle does it
block on the socket, with a timeout so that it still sends heartbeats and notices a dead parent.

Started by the launcher as `python -m tgserve.server.engine.service '<json config>'`. Exit status:
0 after a `Shutdown` message, 1 on any fatal error (reported first as `EngineFailed` when possible),
so that the launcher, and through it the container, restarts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from tgserve.server.config.buckets import BucketConfig
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.core.heap import freeze_startup_heap
from tgserve.server.engine.interface import Engine
from tgserve.server.protocol import messages as p
from tgserve.server.protocol.messages import EngineServiceConfig

logger = logging.getLogger("tgserve.server.engine.service")

IDLE_POLL_MS = 100  # how long an idle loop blocks on its socket: bounds heartbeat and parent checks
HEARTBEAT_S = 0.25  # idle heartbeat period (keeps /metrics current, e.g. KV blocks freed by aborts)
STATS_PERIOD_S = 0.05  # at most this often, a step's outputs carry an EngineStats snapshot


def build_engine(engine_args: dict[str, Any]) -> Engine:
    """Import the engine (torch, the models) only here, so that `--help` and config errors stay fast."""
    from tgserve.server.engine.factory import create_engine

    unsupported = sorted(set(engine_args) - {f.name for f in dataclasses.fields(EngineArgs)})
    if unsupported:
        raise ValueError(
            f"this engine does not support {', '.join(unsupported)} (asked for by the launcher's flags)"
        )
    if isinstance(engine_args.get("buckets"), dict):  # the launcher sends plain JSON
        engine_args = {**engine_args, "buckets": BucketConfig(**engine_args["buckets"])}
    return create_engine(EngineArgs(**engine_args))


def save_tokenizer(engine: Engine, directory: str | None) -> str:
    """Hand the router the engine's own tokenizer files (a GGUF's tokenizer becomes tokenizer.json)."""
    if directory is None:
        return ""
    try:
        engine.tokenizer.save_pretrained(directory)
    except OSError as exc:  # a full disk, most likely: say where, and what was being written
        raise OSError(
            exc.errno, f"cannot write the tokenizer for the router to {directory}: {exc.strerror}"
        ) from exc
    return directory


def ready_message(engine: Engine, tokenizer_dir: str) -> p.EngineReady:
    """Describe the loaded engine to the router."""
    stats = engine.stats()
    pool_tokens = int(engine.max_pool_tokens)
    return p.EngineReady(
        model_id=str(engine.model_id),
        max_model_len=int(engine.max_model_len),
        eos_token_ids=sorted(int(t) for t in engine.eos_token_ids),
        pid=os.getpid(),
        dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device),
        num_total_blocks=int(stats.num_total_blocks),
        block_size=int(engine.args.block_size),
        tokenizer_dir=tokenizer_dir,
        kv_cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."),
        max_servable_tokens=min(int(engine.max_model_len), pool_tokens),
    )


class EngineLoop:
    """Drain requests, step, push outputs. One instance per engine process."""

    def __init__(self, engine: Engine, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int):
        self.engine = engine
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.last_stats_at = 0.0
        self.stepped = False  # since the last stats went out: the first idle loop sends them at once
        self.running = True

    def run(self) -> None:
        """Loop until a `Shutdown` arrives or the parent process disappears."""
        while self.running:
            if os.getppid() != self.parent_pid:
                logger.error("router process %d is gone; engine exiting", self.parent_pid)
                raise SystemExit(1)
            self.drain(timeout_ms=0 if self.needs_step() else IDLE_POLL_MS)
            if not self.running:
                return
            if self.needs_step():
                self.step()
                self.stepped = True
            elif self.stepped or time.monotonic() - self.last_stats_at >= HEARTBEAT_S:
                # As soon as the work ends (a step's stats go out at most every STATS_PERIOD_S, so the
                # last ones may predate its end), then every HEARTBEAT_S while idle.
                self.send(p.Heartbeat(stats=self.engine.stats()))
                self.last_stats_at = time.monotonic()
                self.stepped = False

    def needs_step(self) -> bool:
        """Unfinished requests, or finished ones (aborts) whose runner state a step must still drop."""
        return self.engine.needs_step()

    def drain(self, timeout_ms: int) -> None:
        """Handle every message already queued; block up to timeout_ms only for the first one."""
        if not self.input.poll(timeout_ms):
            return
        while self.running:
            try:
                data = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(p.decode_router_message(data))

    def handle(self, message: p.RouterMessage) -> None:
        """Apply one router message to the engine."""
        if isinstance(message, p.AddRequest):
            self.add_request(message)
        elif isinstance(message, p.AbortRequests):
            self.engine.abort_requests(message.request_ids)
        elif isinstance(message, p.FinishRequest):
            self.engine.finish_request(message.request_id, message.reason)
        elif isinstance(message, p.Ping):
            self.send(p.Pong(ping_id=message.ping_id))
        elif isinstance(message, p.Shutdown):
            self.running = False

    def add_request(self, message: p.AddRequest) -> None:
        """Refusals are per request: the router answers that client with the message, the loop goes on."""
        from tgserve.server.protocol.params import InvalidRequestError

        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.params)
        except InvalidRequestError as exc:
            self.send(p.RequestRejected(message.request_id, str(exc), kind="validation"))
        except (ValueError, TypeError, KeyError) as exc:
            logger.exception("add_request failed for %s", message.request_id)
            self.send(
                p.RequestRejected(message.request_id, f"{type(exc).__name__}: {exc}", kind="generation")
            )

    def step(self) -> None:
        """One engine step; its outputs go out as one message."""
        outputs = self.engine.step()
        stats = None
        now = time.monotonic()
        if now - self.last_stats_at >= STATS_PERIOD_S:
            stats = self.engine.stats()
            self.last_stats_at = now
        if outputs or stats is not None:
            self.send(p.StepOutputs(outputs=list(outputs), stats=stats))

    def send(self, message: p.EngineMessage) -> None:
        self.output.send(p.encode(message))


def connect_sockets(context: zmq.Context, config: EngineServiceConfig) -> tuple[zmq.Socket, zmq.Socket]:
    """The router binds both addresses; the engine connects (it may be restarted, the router not)."""
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(config.input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs: the router drains fast
    output_socket.setsockopt(zmq.LINGER, 2000)  # let EngineFailed reach the router before exit
    output_socket.connect(config.output_address)
    return input_socket, output_socket


def report_failure(output_socket: zmq.Socket, exc: BaseException) -> None:
    """Best effort: tell the router why the engine is about to exit."""
    message = f"{type(exc).__name__}: {exc}"
    try:
        output_socket.send(p.encode(p.EngineFailed(message=message)), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def run_engine_service(config: EngineServiceConfig) -> int:
    """Build the engine, announce it, serve until shutdown. Returns the process exit status."""
    # Ctrl-C in a terminal reaches the whole process group; the launcher decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    input_socket, output_socket = connect_sockets(context, config)
    try:
        engine = build_engine(config.engine_args)
        tokenizer_dir = save_tokenizer(engine, config.tokenizer_dir)
        freeze_startup_heap("engine")
        output_socket.send(p.encode(ready_message(engine, tokenizer_dir)))
        EngineLoop(engine, input_socket, output_socket, config.parent_pid).run()
        engine.close()  # tensor-parallel workers stop with the loop
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    except BaseException as exc:  # noqa: BLE001 - any failure is fatal and must be reported
        traceback.print_exc()
        report_failure(output_socket, exc)
        return 1
    finally:
        input_socket.close(linger=0)
        output_socket.close()
        context.term()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the engine process; the single argument is the JSON `EngineServiceConfig`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tgserve.server.engine.service '<json EngineServiceConfig>'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = msgspec.json.decode(args[0], type=EngineServiceConfig)
    return run_engine_service(config)


if __name__ == "__main__":
    sys.exit(main())
