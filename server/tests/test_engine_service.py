"""The engine process's loop and its messages, with a fake engine over real ipc:// sockets."""

from __future__ import annotations

import os
import threading

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from tgserve.server.engine import service  # noqa: E402
from tgserve.server.protocol import messages as p  # noqa: E402
from tgserve.server.protocol.outputs import EngineStats, RequestOutput  # noqa: E402
from tgserve.server.protocol.params import InvalidRequestError, SamplingParams  # noqa: E402


class FakeEngine:
    """Each request yields max_new_tokens copies of its first prompt token, one per step."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams, int]] = {}
        self.aborted: list[str] = []
        self.finished: list[tuple[str, str]] = []
        self.model_id, self.max_model_len, self.eos_token_ids = "fake", 64, frozenset({0})

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        self.requests[request_id] = (prompt, params, 0)

    def abort_requests(self, ids: list[str]) -> None:
        for request_id in ids:
            self.requests.pop(request_id, None)
            self.aborted.append(request_id)

    def finish_request(self, request_id: str, reason: str) -> None:
        self.requests.pop(request_id, None)
        self.finished.append((request_id, reason))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def needs_step(self) -> bool:
        return self.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, (prompt, params, count) in list(self.requests.items()):
            count += 1
            done = count >= params.max_new_tokens
            outputs.append(
                RequestOutput(request_id, [prompt[0]], None, done, "length" if done else None, 1, 0, count)
            )
            if done:
                del self.requests[request_id]
            else:
                self.requests[request_id] = (prompt, params, count)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 10, 10, 0, 0, 0)


class Harness:
    """The router's side: bound sockets, and the loop running in a thread."""

    def __init__(self, tmp_path, engine: FakeEngine, parent_pid: int | None = None):
        self.context = zmq.Context()
        self.push = self.context.socket(zmq.PUSH)
        self.push.bind(f"ipc://{tmp_path}/in")
        self.pull = self.context.socket(zmq.PULL)
        self.pull.bind(f"ipc://{tmp_path}/out")
        config = service.EngineServiceConfig(
            f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", {}, os.getppid()
        )
        self.engine_context = zmq.Context()
        in_socket, out_socket = service.connect_sockets(self.engine_context, config)
        self.loop = service.EngineLoop(engine, in_socket, out_socket, parent_pid or os.getppid())
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def send(self, message: p.RouterMessage) -> None:
        self.push.send(p.encode(message))

    def receive(self, kind: type, timeout_ms: int = 5000) -> p.EngineMessage:
        while self.pull.poll(timeout_ms):
            message = p.decode_engine_message(self.pull.recv())
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout_ms} ms")

    def close(self) -> None:
        self.send(p.Shutdown())
        self.thread.join(5)
        for socket in (self.push, self.pull, self.loop.input, self.loop.output):
            socket.close(linger=0)
        self.context.term()
        self.engine_context.term()


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path, FakeEngine())
    yield h
    h.close()


def test_messages_round_trip():
    add = p.AddRequest("r", [1, 2], SamplingParams(temperature=0.5, stop=("x",), logit_bias={3: 1.0}))
    assert p.decode_router_message(p.encode(add)) == add
    with pytest.raises(msgspec.ValidationError, match="max_new_tokens"):
        raw = msgspec.msgpack.decode(p.encode(add))  # as plain data, to forge what the router would not send
        raw["params"]["max_new_tokens"] = -1
        p.decode_router_message(msgspec.msgpack.encode(raw))


def test_requests_stream_outputs_until_finished(harness):
    harness.send(p.AddRequest("a", [7], SamplingParams(max_new_tokens=3)))
    tokens = []
    while True:
        message = harness.receive(p.StepOutputs)
        tokens += [t for o in message.outputs for t in o.new_token_ids]
        if any(o.finished for o in message.outputs):
            break
    assert tokens == [7, 7, 7]


def test_invalid_request_is_rejected_and_the_loop_goes_on(harness):
    harness.send(p.AddRequest("bad", [], SamplingParams()))
    rejected = harness.receive(p.RequestRejected)
    assert (rejected.request_id, rejected.kind) == ("bad", "validation")
    harness.send(p.Ping(5))
    assert harness.receive(p.Pong).ping_id == 5


def test_abort_and_finish_reach_the_engine(harness):
    harness.send(p.AddRequest("a", [1], SamplingParams(max_new_tokens=10_000)))
    harness.send(p.AddRequest("b", [1], SamplingParams(max_new_tokens=10_000)))
    harness.receive(p.StepOutputs)
    harness.send(p.AbortRequests(["a"]))
    harness.send(p.FinishRequest("b", "stop_sequence"))
    stats = harness.receive(p.Heartbeat).stats  # idle again: both are gone
    assert stats.num_running == 0
    assert harness.loop.engine.aborted == ["a"] and harness.loop.engine.finished == [("b", "stop_sequence")]


def test_shutdown_ends_the_loop(harness):
    harness.send(p.Shutdown())
    harness.thread.join(5)
    assert not harness.thread.is_alive() and harness.error is None


def test_orphaned_engine_exits(tmp_path):
    h = Harness(tmp_path, FakeEngine(), parent_pid=1)
    h.thread.join(5)
    assert isinstance(h.error, SystemExit) and h.error.code == 1
    h.close()


def test_failure_to_build_is_reported_and_fatal(tmp_path, monkeypatch):
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/out")
    push = context.socket(zmq.PUSH)
    push.bind(f"ipc://{tmp_path}/in")

    def broken(args):
        raise RuntimeError("no such model")

    monkeypatch.setattr(service, "build_engine", broken)
    monkeypatch.setattr(service.signal, "signal", lambda *a: None)
    config = service.EngineServiceConfig(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", {}, os.getppid())
    assert service.run_engine_service(config) == 1
    assert pull.poll(2000)
    failed = p.decode_engine_message(pull.recv())
    assert isinstance(failed, p.EngineFailed) and "no such model" in failed.message
    pull.close(0)
    push.close(0)
    context.term()
