"""Killing the engine process: in-flight requests end with errors, /health stops answering 200 within
a second, and the launcher exits non-zero (so a container restarts)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx


def test_killing_the_engine_fails_requests_and_exits_nonzero(start_server, tiny_model):
    server = start_server(["--model-id", tiny_model, "--max-total-tokens", "512"], name="doomed")
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 480,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def stream(client: httpx.AsyncClient, ready: asyncio.Event) -> list[dict]:
        events = []
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    ready.set()
        return events

    async def blocking(client: httpx.AsyncClient) -> int:
        try:
            return (await client.post("/v1/completions", json=body)).status_code
        except httpx.HTTPError:
            return -1  # the connection closed: also an error, not a hang

    async def health_after_kill() -> float:
        """Seconds from the kill until /health stops answering 200."""
        killed = time.monotonic()
        os.kill(server.engine_pid(), signal.SIGKILL)
        async with httpx.AsyncClient(base_url=server.url, timeout=1) as probe:
            while time.monotonic() - killed < 5:
                try:
                    if (await probe.get("/health")).status_code != 200:
                        break
                except httpx.HTTPError:
                    break
                await asyncio.sleep(0.02)
        return time.monotonic() - killed

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            readies = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(stream(client, ready)) for ready in readies]
            pending = asyncio.create_task(blocking(client))
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 60)
            unhealthy_after = await health_after_kill()
            return await asyncio.gather(*streams), await pending, unhealthy_after

    streams, pending_status, unhealthy_after = asyncio.run(asyncio.wait_for(run(), 60))
    for events in streams:
        assert "error" in events[-1], events[-1]
        assert "engine" in events[-1]["error"]["message"]
    assert pending_status in (503, -1)
    assert unhealthy_after < 1.0
    assert server.process.wait(timeout=30) != 0


def test_sigterm_stops_router_and_engine_cleanly(start_server, tiny_model):
    server = start_server(["--model-id", tiny_model], name="stopped")
    engine_pid = server.engine_pid()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{engine_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (
        not Path(f"/proc/{engine_pid}").exists()
        or "Z" in Path(f"/proc/{engine_pid}/stat").read_text().split()[2]
    )
