"""Soak: a steady rate of mixed requests for SOAK_SECONDS (default 600; `make reliability`).

The mix: completions and chat, streamed and not, prompts of 1 to 20 words, `n` of 1 to 3, stop
strings that often match, and about one request in ten left by its client (a stream closed after its
first event, or before any). What must hold: every request not left by its client completes with a
200, `n` choices, finish reasons and no stop string in its text; once idle, no KV block is in use; the
router's and the engine's resident memory grow by less than RSS_GROWTH_BOUND_MB after the warm-up.
Prints the request counts, the KV blocks in use and both processes' RSS, for docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import openai

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "600"))
WARM_UP_S = min(30.0, SOAK_SECONDS / 4)  # the same load first: allocators and caches reach their size
RATE_PER_S = 8.0  # arrivals a second, whatever the answers' pace (an open loop, as real clients are)
ABORT_SHARE = 0.1
CLIENT_TIMEOUT_S = 60.0
# After the warm-up a process holds what its steady state needs: what it grows by then is the
# allocators' slack (a few MB, docs/reliability.md) or a leak. Over the ~4,800 requests of the
# default soak, a leak of 4 kB a request (a queue, a sequence's tokens and text left behind) passes this.
RSS_GROWTH_BOUND_MB = 20.0
WORDS = "the river mill road village winter bread lantern bridge market story morning".split()
STOP_STRINGS = ("e", "an", "the", "\n", "zq")  # random text from the tiny model often has the first ones


@dataclass(frozen=True)
class Request:
    """One request of the mix, drawn from a seeded generator so that a run can be repeated."""

    chat: bool
    stream: bool
    prompt: str
    n: int
    max_tokens: int
    stop: list[str] | None
    leave_after_events: int | None  # the client leaves after this many events (None: it stays)


def draw_request(rng: random.Random) -> Request:
    leave = rng.random() < ABORT_SHARE
    stop = rng.sample(STOP_STRINGS, rng.randint(1, 2)) if rng.random() < 0.5 else None
    return Request(
        chat=rng.random() < 0.5,
        stream=leave or rng.random() < 0.5,
        prompt=" ".join(rng.choices(WORDS, k=rng.randint(1, 20))),
        n=rng.randint(1, 3),
        max_tokens=rng.randint(4, 48),
        stop=stop,
        leave_after_events=rng.choice((0, 1)) if leave else None,
    )


async def send(client: openai.AsyncOpenAI, request: Request, stream: bool):
    common = {"model": "tiny", "n": request.n, "max_tokens": request.max_tokens, "stop": request.stop,
              "temperature": 0.8, "stream": stream}  # fmt: skip
    if request.chat:
        return await client.chat.completions.create(
            messages=[{"role": "user", "content": request.prompt}], **common
        )
    return await client.completions.create(prompt=request.prompt, **common)


def chunk_pieces(chunk, chat: bool) -> list[tuple[int, str, str | None]]:
    """(choice index, text, finish reason) of each choice in a streamed chunk."""
    if chat:
        return [(c.index, c.delta.content or "", c.finish_reason) for c in chunk.choices]
    return [(c.index, c.text, c.finish_reason) for c in chunk.choices]


def whole_pieces(response, chat: bool) -> list[tuple[int, str, str | None]]:
    if chat:
        return [(c.index, c.message.content or "", c.finish_reason) for c in response.choices]
    return [(c.index, c.text, c.finish_reason) for c in response.choices]


async def run_request(client: openai.AsyncOpenAI, request: Request) -> str:
    """'ok', 'stopped' (ok, a choice ended by a stop string or the end of text), 'left' (the client
    left on purpose), or what went wrong."""
    try:
        if request.leave_after_events is not None:
            return await leave_early(client, request)
        if request.stream:
            pieces: list[tuple[int, str, str | None]] = []
            async for chunk in await send(client, request, stream=True):
                pieces += chunk_pieces(chunk, request.chat)
        else:
            pieces = whole_pieces(await send(client, request, stream=False), request.chat)
    except openai.APIError as exc:
        return f"{type(exc).__name__}: {exc}"
    return check_answer(request, pieces)


async def leave_early(client: openai.AsyncOpenAI, request: Request) -> str:
    stream = await send(client, request, stream=True)
    events = 0
    async for _ in stream:
        events += 1
        if events >= request.leave_after_events:
            break
    await stream.close()  # closes the connection: the server aborts the rest
    return "left"


def check_answer(request: Request, pieces: list[tuple[int, str, str | None]]) -> str:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for index, text, reason in pieces:
        texts[index] = texts.get(index, "") + text
        reasons[index] = reason or reasons.get(index)
    if sorted(reasons) != list(range(request.n)) or None in reasons.values():
        return f"wrong choices or finish reasons: {reasons}"
    leaked = [t for t in texts.values() for s in request.stop or () if s in t]
    if leaked:
        return f"a stop string in the text: {leaked[0]!r}"
    return "stopped" if "stop" in reasons.values() else "ok"


def rss_mb(pid: int) -> float:
    """Resident memory from /proc (as the conftest reads the engine's pid there)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def blocks_in_use(gauges: dict[str, float]) -> float:
    return gauges["tgserve_kv_cache_total_blocks"] - gauges["tgserve_kv_cache_free_blocks"]


async def steady_load(server, seconds: float, rng: random.Random, peak: dict[str, float]) -> Counter:
    """Requests at RATE_PER_S for `seconds`, every one awaited; outcomes counted. `peak` gets the most
    KV blocks in use seen meanwhile."""
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    async with client:
        started = time.monotonic()
        tasks = []
        for i in range(int(seconds * RATE_PER_S)):
            await asyncio.sleep(max(0.0, started + i / RATE_PER_S - time.monotonic()))
            tasks.append(asyncio.create_task(run_request(client, draw_request(rng))))
            if i % int(RATE_PER_S * 5) == 0:  # every 5 s
                in_use = blocks_in_use(await asyncio.to_thread(server.gauges))
                peak["blocks"] = max(peak.get("blocks", 0), in_use)
        outcomes = await asyncio.gather(*tasks)
    return Counter(o if o in ("ok", "stopped", "left") else f"error: {o}" for o in outcomes)


@dataclass(frozen=True)
class Snapshot:
    router_mb: float
    engine_mb: float
    blocks_in_use: float


def idle_snapshot(server, engine_pid: int) -> Snapshot:
    gauges = server.wait_until_idle(timeout_s=60)
    return Snapshot(rss_mb(server.process.pid), rss_mb(engine_pid), blocks_in_use(gauges))


def test_steady_mixed_load_leaks_nothing(start_tiny_server):
    # Longer prompts than TINY_ARGS allows: a chat template around 20 words.
    server = start_tiny_server("--max-input-tokens", "128", name="soak")
    engine_pid, rng, peak = server.engine_pid(), random.Random(39), {}
    wall_started = time.monotonic()
    warm_up = asyncio.run(steady_load(server, WARM_UP_S, rng, peak))
    before = idle_snapshot(server, engine_pid)
    outcomes = asyncio.run(steady_load(server, SOAK_SECONDS, rng, peak))
    after = idle_snapshot(server, engine_pid)
    completed = outcomes["ok"] + outcomes["stopped"]
    aborted = server.sample("tgi_request_failure", err="aborted")  # the server's count, warm-up included
    errors = {k: v for k, v in (warm_up + outcomes).items() if k.startswith("error")}
    print(
        f"\nsoak: {SOAK_SECONDS:.0f} s at {RATE_PER_S:g} requests/s after a {WARM_UP_S:.0f} s warm-up "
        f"({time.monotonic() - wall_started:.0f} s in all): {completed} completed ({outcomes['stopped']} with a "
        f"choice stopped), {outcomes['left']} left by their clients "
        f"({aborted:.0f} aborted by the server), {sum(errors.values())} errors"
    )
    print(
        f"  KV blocks in use: {before.blocks_in_use:.0f} before, peak {peak['blocks']:.0f}, {after.blocks_in_use:.0f} after"
    )
    print(
        f"  RSS router {before.router_mb:.0f} -> {after.router_mb:.0f} MB, engine {before.engine_mb:.0f} -> {after.engine_mb:.0f} MB"
    )

    assert not errors, errors
    assert outcomes["left"] > 0 and outcomes["stopped"] > 0 and outcomes["ok"] > 0
    # A client that leaves after the last event leaves nothing to abort; none is aborted otherwise.
    assert 0 < aborted <= warm_up["left"] + outcomes["left"]
    assert before.blocks_in_use == 0 and after.blocks_in_use == 0
    assert after.router_mb - before.router_mb < RSS_GROWTH_BOUND_MB
    assert after.engine_mb - before.engine_mb < RSS_GROWTH_BOUND_MB
