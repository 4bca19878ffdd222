"""Faults while serving (`make reliability`), each on a server of its own.

- The engine process killed (SIGKILL) or stopped (SIGSTOP) mid-stream: every client gets an error
  naming the engine (or its whole answer) within ANSWER_BOUND_S, /health answers 503 soon after the
  fault can be seen, and the launcher exits non-zero so that a container restarts.
- A client that leaves while its request is queued, during its prefill, during decoding, or while
  the server is writing to it: the request is aborted, every KV block is free again and the server
  goes on serving.
- The ipc:// socket directory between router and engine removed: the connections already made carry
  on (requests and /health answer 200) and the server still shuts down cleanly.
- A tensor-parallel shard worker killed mid-stream (`--num-shard 2`, on the CPU through gloo): as the
  engine killed, once rank 0's watch has seen the worker gone.
- The disk full while the engine writes the tokenizer for the router (a 4 KiB tmpfs as TMPDIR; needs
  root to mount it, skipped otherwise): the launcher exits non-zero within STARTUP_BOUND_S, its log
  naming the full disk, and no process is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

ANSWER_BOUND_S = 30.0  # every client of a faulted server has its answer or its error by then
HEALTH_BOUND_S = 1.0  # /health is 503 within this of the fault becoming visible to it
STALL_TIMEOUT_S = 5  # --engine-stall-timeout of the SIGSTOP server: short, to keep the test short
STOPPED_HEALTH_TIMEOUT_S = 1  # --health-timeout of the SIGSTOP server: how long a ping may go unanswered
NUM_STREAMS = 4
WORKER_WATCH_S = 0.5  # how often rank 0 looks for a dead shard worker (shard_workers.WorkerWatch)
STARTUP_BOUND_S = 120.0  # a server that cannot start has exited by then (the tiny model loads in seconds)


# ---- the engine killed or stopped mid-stream ---------------------------------------------------


@dataclass(frozen=True)
class StreamEnd:
    """How one stream ended: `complete` (a finish reason), `error` (an error event or status), or
    `cut` (the connection closed with neither)."""

    kind: str
    detail: str
    ended_at: float  # time.monotonic()


async def long_stream(client: openai.AsyncOpenAI, index: int, streaming: asyncio.Event) -> StreamEnd:
    try:
        stream = await client.completions.create(
            model="tiny", prompt=f"Story {index}: once upon a time", max_tokens=240, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        reason = None
        async for chunk in stream:
            streaming.set()
            reason = chunk.choices[0].finish_reason or reason
    except openai.APIConnectionError as exc:  # includes the client's own timeout
        return StreamEnd("cut", repr(exc), time.monotonic())
    except openai.APIError as exc:
        return StreamEnd("error", exc.message, time.monotonic())
    return StreamEnd("complete" if reason else "cut", reason or "", time.monotonic())


async def seconds_until_unhealthy(server, since: float, bound_s: float) -> float:
    """Poll /health until it is not 200 (or does not answer); seconds from `since`, inf past bound_s."""
    async with httpx.AsyncClient(base_url=server.url, timeout=bound_s) as probe:
        while time.monotonic() - since < bound_s:
            try:
                if (await probe.get("/health")).status_code != 200:
                    return time.monotonic() - since
            except httpx.HTTPError:
                return time.monotonic() - since
            await asyncio.sleep(0.02)
    return float("inf")


@dataclass(frozen=True)
class FaultOutcome:
    ends: list[StreamEnd]
    unhealthy_after_s: float  # from the fault until /health stopped answering 200
    answered_after_s: float  # from the fault until the last stream ended


async def fault_mid_stream(server, fault: signal.Signals, pid: int | None = None) -> FaultOutcome:
    """Start NUM_STREAMS long streams, send `fault` to the engine (or to `pid`) once all stream; how it
    went."""
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=ANSWER_BOUND_S
    )
    async with client:
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        streams = [asyncio.create_task(long_stream(client, i, e)) for i, e in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        faulted_at = time.monotonic()
        os.kill(pid or server.engine_pid(), fault)
        unhealthy_after = await seconds_until_unhealthy(server, faulted_at, ANSWER_BOUND_S)
        ends = await asyncio.wait_for(asyncio.gather(*streams), ANSWER_BOUND_S)
    return FaultOutcome(ends, unhealthy_after, max(end.ended_at for end in ends) - faulted_at)


def assert_streams_failed_naming_the_engine(outcome: FaultOutcome) -> None:
    for end in outcome.ends:
        assert end.kind in ("error", "complete"), end
        assert end.kind == "complete" or "engine" in end.detail, end
    assert outcome.answered_after_s < ANSWER_BOUND_S


def assert_launcher_exits_nonzero_with_the_engine_gone(server, engine_pid: int) -> int:
    status = server.process.wait(timeout=ANSWER_BOUND_S)
    assert status != 0, server.log_tail()
    assert not Path(f"/proc/{engine_pid}").exists(), "the engine process outlived the launcher"
    return status


def describe(outcome: FaultOutcome) -> str:
    kinds = ", ".join(sorted({end.kind for end in outcome.ends}))
    return (
        f"/health 503 after {outcome.unhealthy_after_s * 1e3:.0f} ms, every stream ended ({kinds}) "
        f"{outcome.answered_after_s:.2f} s after the fault"
    )


def test_engine_killed_mid_stream(start_tiny_server):
    server = start_tiny_server(name="sigkill")
    engine_pid = server.engine_pid()
    outcome = asyncio.run(fault_mid_stream(server, signal.SIGKILL))
    status = assert_launcher_exits_nonzero_with_the_engine_gone(server, engine_pid)
    print(f"\nengine SIGKILL mid-stream: {describe(outcome)}; launcher exit {status}")
    assert_streams_failed_naming_the_engine(outcome)
    assert outcome.unhealthy_after_s < HEALTH_BOUND_S


def test_engine_stopped_mid_stream(start_tiny_server):
    """A stopped engine is alive but silent: /health's ping goes unanswered (503 after
    --health-timeout), and --engine-stall-timeout later the launcher kills it, fails the streams and
    exits non-zero."""
    server = start_tiny_server(
        "--health-timeout", str(STOPPED_HEALTH_TIMEOUT_S), "--engine-stall-timeout", str(STALL_TIMEOUT_S),
        name="sigstop",
    )  # fmt: skip
    engine_pid = server.engine_pid()
    try:
        outcome = asyncio.run(fault_mid_stream(server, signal.SIGSTOP))
        status = assert_launcher_exits_nonzero_with_the_engine_gone(server, engine_pid)
    finally:
        if Path(f"/proc/{engine_pid}").exists():
            os.kill(engine_pid, signal.SIGCONT)  # so that the session's clean-up can stop it
    print(
        f"\nengine SIGSTOP mid-stream (--health-timeout {STOPPED_HEALTH_TIMEOUT_S}, --engine-stall-timeout "
        f"{STALL_TIMEOUT_S}): {describe(outcome)}; launcher exit {status}"
    )
    assert_streams_failed_naming_the_engine(outcome)
    assert outcome.unhealthy_after_s < STOPPED_HEALTH_TIMEOUT_S + HEALTH_BOUND_S


# ---- clients that leave --------------------------------------------------------------------------

PREFILL_BUDGET = 2  # tokens a step: a long prompt's prefill takes many steps, so a client can leave mid-way
HEARTBEAT_WAIT_S = 0.5  # two of the idle engine's heartbeats: its counters in /metrics are then current


def long_prompt(tag: str) -> str:
    """About 180 tokens (90 prefill steps); each tag its own, so that no prefix cache shortens one."""
    return f"{tag} " + " ".join(f"w{i}" for i in range(62))


def prefill_steps(server) -> float:
    return server.sample("tgi_batch_inference_count", method="prefill")


def aborted_requests(server) -> float:
    return server.sample("tgi_request_failure", err="aborted")


async def wait_for_gauge(server, name: str, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await asyncio.to_thread(server.gauges))[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.02)


def stream_request(**body) -> dict:
    return {"model": "tiny", "temperature": 0, "stream": True, **body}


async def open_stream(client: httpx.AsyncClient, server, body: dict) -> httpx.Response:
    """A streaming request whose response headers have arrived: the engine has the request."""
    request = client.build_request("POST", "/v1/completions", json=body, headers=server.headers)
    response = await client.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    return response


async def leave_while_queued(server, client: httpx.AsyncClient) -> None:
    """With --max-batch-size 1 and a long request running, the next one waits in the engine's queue."""
    runner = await open_stream(client, server, stream_request(prompt="Hi", max_tokens=240, ignore_eos=True))
    lines = runner.aiter_lines()
    await anext(lines)
    queued = await open_stream(client, server, stream_request(prompt=long_prompt("queued"), max_tokens=8))
    await wait_for_gauge(server, "tgi_queue_size", 1)
    await queued.aclose()
    async for _ in lines:  # the running request is served to its end
        pass
    await runner.aclose()


async def leave_during_prefill(server, client: httpx.AsyncClient) -> None:
    response = await open_stream(client, server, stream_request(prompt=long_prompt("prefill"), max_tokens=8))
    await response.aclose()


async def leave_during_decode(server, client: httpx.AsyncClient) -> None:
    body = stream_request(prompt="Tell me a story", max_tokens=240, ignore_eos=True)
    response = await open_stream(client, server, body)
    events = 0
    async for line in response.aiter_lines():
        events += line.startswith("data: ")
        if events == 3:
            break
    await response.aclose()


async def leave_mid_write(server, client: httpx.AsyncClient) -> None:
    """A client with a small receive window reads part of the first event and stops reading; once the
    server's socket holds bytes it cannot send (the stream of four sequences with their
    log-probabilities is far longer than the buffers), the client resets the connection."""
    body = stream_request(prompt="Tell me a story", max_tokens=200, ignore_eos=True, n=4, logprobs=5)
    await asyncio.to_thread(reset_mid_event, server, json.dumps(body).encode())


def reset_mid_event(server, body: bytes) -> None:
    with socket.socket() as sock:
        sock.settimeout(ANSWER_BOUND_S)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        received = b""
        while b"data: " not in received:
            piece = sock.recv(64)
            assert piece, received
            received += piece
        assert received.startswith(b"HTTP/1.1 200"), received
        wait_until_unsent(server.port, sock.getsockname()[1])
        # SO_LINGER 0: close with a reset, as a client that crashes or times out does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def wait_until_unsent(local_port: int, remote_port: int, timeout_s: float = ANSWER_BOUND_S) -> None:
    """Until the loopback socket local_port -> remote_port has bytes queued that its peer has not
    taken (tx_queue in /proc/net/tcp): the peer's window is full and the writer is held up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            _, local, remote, _, queues = line.split()[:5]  # addresses as HEXIP:HEXPORT, tx:rx
            ports = (int(local.split(":")[1], 16), int(remote.split(":")[1], 16))
            if ports == (local_port, remote_port) and int(queues.split(":")[0], 16) > 0:
                return
        time.sleep(0.02)
    raise AssertionError("the server never had bytes waiting for the client")


def test_clients_leaving_at_every_stage_free_everything(start_tiny_server):
    server = start_tiny_server(
        "--max-batch-size", "1", "--max-batch-prefill-tokens", str(PREFILL_BUDGET), "--max-input-tokens", "200",
        name="disconnects",
    )  # fmt: skip
    stages = {
        "queued": leave_while_queued,
        "prefill": leave_during_prefill,
        "decode": leave_during_decode,
        "mid-write": leave_mid_write,
    }
    for stage, leave in stages.items():
        prefills = run_stage(server, stage, leave)
        print(
            f"\nclient left while {stage}: aborted, every KV block free, prefill steps of the stage {prefills:.0f}"
        )


def run_stage(server, stage: str, leave) -> float:
    """Run one stage; check the request was aborted and everything freed; return the stage's prefill steps."""
    settled_gauges(server)
    aborted, prefills = aborted_requests(server), prefill_steps(server)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=ANSWER_BOUND_S) as client:
            await asyncio.wait_for(leave(server, client), ANSWER_BOUND_S)

    asyncio.run(run())
    gauges = settled_gauges(server)
    assert gauges["tgserve_kv_cache_free_blocks"] == gauges["tgserve_kv_cache_total_blocks"], stage
    assert gauges["tgserve_requests_in_flight"] == 0, stage
    assert aborted_requests(server) == aborted + 1, stage
    stage_prefills = prefill_steps(server) - prefills
    assert_stage_was_reached(server, stage, stage_prefills)
    assert_still_serves(server)
    return stage_prefills


def settled_gauges(server) -> dict[str, float]:
    """The gauges once idle, and the engine's counters after its next heartbeats: the last steps'
    stats may not have been sent with their outputs."""
    server.wait_until_idle()
    time.sleep(HEARTBEAT_WAIT_S)
    return server.gauges()


def assert_stage_was_reached(server, stage: str, stage_prefills: float) -> None:
    """The engine's prefill steps show where the client left: a queued request is never prefilled
    (the runner's short prompt takes one step), one left during prefill was cut short of its steps."""
    if stage == "queued":
        assert stage_prefills == 1, stage_prefills
    elif stage == "prefill":
        tokens = httpx.post(
            f"{server.url}/tokenize", json={"prompt": long_prompt(stage)}, headers=server.headers
        )
        assert 0 < stage_prefills < -(-tokens.json()["count"] // PREFILL_BUDGET), stage_prefills


def assert_still_serves(server) -> None:
    answer = httpx.post(
        f"{server.url}/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
        headers=server.headers,
        timeout=ANSWER_BOUND_S,
    )
    assert answer.status_code == 200, answer.text


# ---- the ipc socket directory removed ----------------------------------------------------------


def ipc_directory(server) -> Path:
    """Where the router's ipc:// sockets are: from the engine's command line (its JSON config)."""
    arguments = Path(f"/proc/{server.engine_pid()}/cmdline").read_bytes().split(b"\0")
    config = json.loads(next(a for a in arguments if a.startswith(b"{")))
    return Path(config["input_address"].removeprefix("ipc://")).parent


def test_ipc_directory_removed_while_serving(start_tiny_server):
    server = start_tiny_server(name="ipc")
    directory = ipc_directory(server)
    assert (directory / "engine-input").is_socket()
    shutil.rmtree(directory)
    health = httpx.get(f"{server.url}/health", timeout=ANSWER_BOUND_S)
    answer = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 8},
        headers=server.headers,
        timeout=ANSWER_BOUND_S,
    )
    print(f"\nipc directory removed: /health {health.status_code}, a completion {answer.status_code}")
    # Either the connections already made carry on, or the server says why it cannot serve.
    if answer.status_code != 200:
        assert answer.status_code == 503 and "engine" in answer.text, answer.text
        assert health.status_code == 503
    else:
        assert health.status_code == 200
    engine_pid = server.engine_pid()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=ANSWER_BOUND_S) == 0, server.log_tail()
    assert not Path(f"/proc/{engine_pid}").exists()


# ---- a tensor-parallel shard worker killed ---------------------------------------------------


def shard_worker_pids(engine_pid: int) -> list[int]:
    """The engine's shard workers: its children that multiprocessing spawned to run a worker (its
    resource tracker, if any, is not one)."""
    children = []
    for task in Path(f"/proc/{engine_pid}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    return [
        pid
        for pid in children
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


def test_shard_worker_killed_mid_stream(start_tiny_server):
    server = start_tiny_server("--num-shard", "2", name="shard-kill")
    engine_pid = server.engine_pid()
    workers = shard_worker_pids(engine_pid)
    assert len(workers) == 1, workers
    outcome = asyncio.run(fault_mid_stream(server, signal.SIGKILL, workers[0]))
    status = assert_launcher_exits_nonzero_with_the_engine_gone(server, engine_pid)
    print(
        f"\nshard worker SIGKILL mid-stream (--num-shard 2, gloo): {describe(outcome)}; launcher exit {status}; "
        f"a stream's error: {outcome.ends[0].detail[:200]!r}"
    )
    assert_streams_failed_naming_the_engine(outcome)
    assert "shard worker" in server.log_tail(), server.log_tail()  # the error names the dead worker
    assert outcome.unhealthy_after_s < WORKER_WATCH_S + HEALTH_BOUND_S
    assert wait_gone(workers[0])


# ---- the disk full while writing the tokenizer -----------------------------------------------


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A 4 KiB tmpfs: too small for the tokenizer's files."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_while_writing_the_tokenizer(start_tiny_server, full_disk):
    started = time.monotonic()
    server = start_tiny_server(name="disk-full", ready=False, env={"TMPDIR": str(full_disk)})
    engine_pid = None
    while server.process.poll() is None and engine_pid is None:  # for the check that it is gone
        children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
        engine_pid = (
            next(iter(int(p) for p in children.read_text().split()), None) if children.exists() else None
        )
        time.sleep(0.05)
    status = server.process.wait(timeout=STARTUP_BOUND_S)
    seconds = time.monotonic() - started
    log = server.log_tail()
    reason = next((line for line in reversed(log.splitlines()) if "No space left" in line), "")
    print(
        f"\ndisk full while writing the tokenizer: launcher exit {status} after {seconds:.1f} s: {reason[-200:]!r}"
    )
    assert status != 0, log
    assert "cannot write the tokenizer for the router" in log and "No space left on device" in log, log
    assert engine_pid is None or wait_gone(engine_pid), "the engine process outlived the launcher"
