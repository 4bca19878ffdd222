"""The real `tgserve serve` process on a free loopback port, for tests that drive it with real clients.

Servers are expensive (a model load each), so each is shared by the whole session: `tiny_server`
and `smol_server`; tests that must kill one start their own with `start_server`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 600  # a cold SmolLM2 load on two busy cores
# On a GPU host every server of the session and the tests' offline engines share the GPU, each with
# its own share of its memory (the CPU ignores it): the suite starts about ten servers.
GPU_SHARE = 0.05
API_KEY = "integration-secret"
TINY_ARGS = ["--max-input-tokens", "64", "--max-total-tokens", "256", "--api-key", API_KEY]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m tgserve serve ...` with its output in a log file."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        api_key: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        command = [
            sys.executable,
            "-m",
            "tgserve",
            "serve",
            "--hostname",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--gpu-memory-utilization",
            str(GPU_SHARE),
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("API_KEY", None)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command + args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s}s:\n{self.log_tail()}")

    def gauges(self) -> dict[str, float]:
        """/metrics as {name: first sample's value}, through the Prometheus text parser."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}

    def sample(self, name: str, **labels: str) -> float:
        """One sample of /metrics by its name and labels (a labelled counter such as
        `tgi_request_failure{err="aborted"}`), 0 when the server has not written it yet. The parser
        names counters' samples `<name>_total` whether or not the text does (TGI's do not)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (name, f"{name}_total") and sample.labels == labels:
                    return sample.value
        return 0.0

    def wait_until_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        """The engine pushes stats while idle: the gauges once they show no work and every block
        free (or as they are after `timeout_s`), read after an idle engine's next push (every
        0.25 s): a snapshot from before the last request also shows an idle engine, without what
        that request changed."""
        now = time.monotonic()
        deadline, fresh_at = now + timeout_s, now + 0.5
        while True:
            gauges = self.gauges()
            idle = gauges["tgi_batch_current_size"] == 0 and gauges["tgi_queue_size"] == 0
            all_free = gauges["tgserve_kv_cache_free_blocks"] == gauges["tgserve_kv_cache_total_blocks"]
            if idle and all_free and time.monotonic() >= fresh_at:
                return gauges
            if time.monotonic() > deadline:
                return gauges
            time.sleep(0.2)

    def engine_pid(self) -> int:
        """The launcher's one child process is the engine."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        children = [int(pid) for pid in path.read_text().split()]
        assert len(children) == 1, f"expected one engine process, found {children}"
        return children[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A factory: start_server(args, api_key=None) -> a ready ServerProcess, stopped at session end;
    with ready=False, the process as soon as it is launched (port: a given one, else a free one;
    env: variables set for the server beside this process's)."""
    servers: list[ServerProcess] = []

    def start(
        args: list[str],
        api_key: str | None = None,
        name: str = "server",
        port: int | None = None,
        ready: bool = True,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        log = tmp_path_factory.mktemp(name) / "server.log"
        server = ServerProcess(args, log, api_key, port, env)
        servers.append(server)
        return server.wait_ready() if ready else server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def offline_llm():
    """offline_llm(model=None): the offline `LLM` API, with a server's share of a GPU (GPU_SHARE)."""
    from tgserve import LLM

    return lambda model=None: LLM(model, gpu_memory_utilization=GPU_SHARE)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from tgserve.server.testing.fixtures import fixture_path

    return str(fixture_path("llama"))


@pytest.fixture(scope="session")
def tiny_server(start_server, tiny_model: str) -> ServerProcess:
    """The tiny random Llama, with an API key and small token limits (bad-input tests use them)."""
    return start_server(["--model-id", tiny_model, *TINY_ARGS], api_key=API_KEY, name="tiny")


@pytest.fixture(scope="session")
def start_tiny_server(start_server, tiny_model: str):
    """start_tiny_server(*flags, name="tiny", ready=True, env=None): a server of its own on the tiny
    Llama, with tiny_server's API key and token limits, then `flags` (given again, a flag overrides
    its TINY_ARGS value)."""

    def start(
        *flags: str, name: str = "tiny", ready: bool = True, env: dict[str, str] | None = None
    ) -> ServerProcess:
        return start_server(
            ["--model-id", tiny_model, *TINY_ARGS, *flags], api_key=API_KEY, name=name, ready=ready, env=env
        )

    return start


@pytest.fixture(scope="session")
def smol_server(start_server) -> ServerProcess:
    """The default model (SmolLM2-135M-Instruct, no --model-id): loading it on a CPU takes a while."""
    return start_server([], name="smollm2")
