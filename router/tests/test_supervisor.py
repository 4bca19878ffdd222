"""The launcher's watch over the engine process: a stalled engine (stopped, or stuck in one step) is
killed like a dead one, so requests fail and the server exits instead of waiting for ever."""

from __future__ import annotations

import asyncio
import subprocess
import time
from types import SimpleNamespace

from tgserve.router import supervisor


class SilentClient:
    """The parts of EngineClient the watcher uses: when the engine last spoke, and whether it answers."""

    def __init__(self, silent_for_s: float, answers_ping: bool):
        self.last_message_at = time.monotonic() - silent_for_s
        self.answers_ping = answers_ping
        self.dead_reason: str | None = None

    async def ping(self, timeout_s: float) -> bool:
        if self.answers_ping:
            self.last_message_at = time.monotonic()
        return self.answers_ping

    def fail(self, reason: str) -> None:
        self.dead_reason = self.dead_reason or reason


def sleeping_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def test_a_silent_engine_that_does_not_answer_is_killed_and_fails_requests():
    process, client, server = sleeping_process(), SilentClient(10, answers_ping=False), SimpleNamespace()
    died = asyncio.run(asyncio.wait_for(supervisor.watch_engine(process, client, server, 5.0), 10))
    assert died and server.should_exit
    assert process.returncode == -9
    assert "sent nothing for 5s" in client.dead_reason


def test_a_silent_engine_that_answers_a_ping_or_a_disabled_watch_is_left_alone():
    for client, timeout_s in ((SilentClient(10, answers_ping=True), 5.0), (SilentClient(10, False), 0.0)):
        process = sleeping_process()
        watcher = supervisor.watch_engine(process, client, SimpleNamespace(), timeout_s)
        try:
            asyncio.run(asyncio.wait_for(watcher, 0.5))
        except asyncio.TimeoutError:
            pass  # still watching: the engine was not judged stalled
        assert process.poll() is None and client.dead_reason is None
        process.kill()
        process.wait()
