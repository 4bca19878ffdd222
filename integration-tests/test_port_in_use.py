"""The HTTP port: held from the launcher's first second (the engine's shard workers, started while
the model loads, open ports of their own and must not take it), and a taken one fails at once."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest


def serve_command(port: int, model: str) -> list[str]:
    return [sys.executable, "-m", "tgserve", "serve", "--hostname", "127.0.0.1", "--port", str(port),
            "--model-id", model]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_taken_port_fails_before_the_model_loads(tiny_model):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(serve_command(port, tiny_model), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: the address is in use" in done.stderr
    assert "starting the engine" not in done.stderr


def test_the_port_is_held_while_the_engine_loads(tiny_model, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(serve_command(port, tiny_model), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "starting the engine" not in log.read_text(errors="replace"):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        with socket.socket() as intruder, pytest.raises(OSError):  # a plain bind, as a shard worker's
            intruder.bind(("127.0.0.1", port))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
