"""The HTTP port: held from the launcher's first second (the engine's shard workers, started while
the model loads, open ports of their own and must not take it), and a taken one fails at once."""

from __future__ import annotations

import socket
import time

import pytest


def test_a_taken_port_fails_before_the_model_loads(start_server, tiny_model):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = start_server(["--model-id", tiny_model], name="taken", port=port, ready=False)
        assert server.process.wait(timeout=120) == 1
    log = server.log_path.read_text(errors="replace")
    assert f"cannot listen on 127.0.0.1:{port}: the address is in use" in log
    assert "starting the engine" not in log


def test_the_port_is_held_while_the_engine_loads(start_server, tiny_model):
    server = start_server(["--model-id", tiny_model], name="loading", ready=False)
    deadline = time.monotonic() + 120
    while "starting the engine" not in server.log_tail():
        assert server.process.poll() is None and time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)
    with socket.socket() as intruder, pytest.raises(OSError):  # a plain bind, as a shard worker's
        intruder.bind(("127.0.0.1", server.port))
    server.stop()
