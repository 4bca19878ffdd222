"""Overload: 256 streaming clients at once against --max-concurrent-requests 128 (`make reliability`).

What must hold: each client is either admitted, and its stream ends with a finish reason and the same
text as the greedy answer to its prompt computed alone (batching 128 requests changes nothing), or
refused with a 429 without waiting for a slot; nothing else (no 5xx, no hang), and never more
streams at once than the limit. In the burst a 429 takes as long as the router needs to read and
validate the requests that arrived with it, so the promptness of a refusal is timed alone: a
request sent while 128 streams hold every slot.
Afterwards the server still serves, and every KV block is free again. Prints the admitted and refused
counts, the time to first token and total latency of the admitted streams, and the refusals' times,
for docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import httpx
import openai

NUM_CLIENTS = 256
MAX_CONCURRENT = 128
MAX_TOKENS = 32
PROMPTS = [f"Visitor {i} asks the way to the old mill by the river" for i in range(8)]
CLIENT_TIMEOUT_S = 60.0
BURST_BOUND_S = 120.0  # the whole burst; a hang fails the test here rather than in the client
REFUSAL_BOUND_S = 1.0  # a lone refusal needs no engine work: validation, then admission says no
NUM_PROBES = 5


@dataclass(frozen=True)
class Outcome:
    """One client's result: `status` 200 (admitted), 429 (refused) or another code (-1: no status, as
    for a timeout, a dropped connection or an error event in the stream)."""

    status: int
    prompt: str
    text: str = ""
    finish_reason: str | None = None
    first_token_s: float | None = None
    total_s: float = 0.0
    error: str = ""


async def greedy_reference(client: openai.AsyncOpenAI, prompt: str) -> str:
    response = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    return response.choices[0].text


async def stream_once(client: openai.AsyncOpenAI, prompt: str) -> Outcome:
    started = time.monotonic()
    try:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        text, reason, first_token_s = "", None, None
        async for chunk in stream:
            first_token_s = first_token_s or time.monotonic() - started
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    except openai.APIStatusError as exc:
        return Outcome(exc.status_code, prompt, total_s=time.monotonic() - started, error=str(exc))
    except openai.APIError as exc:
        return Outcome(-1, prompt, total_s=time.monotonic() - started, error=repr(exc))
    return Outcome(200, prompt, text, reason, first_token_s, time.monotonic() - started)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def spread(values: list[float]) -> str:
    return f"p50 {percentile(values, 50) * 1e3:.0f} ms, p99 {percentile(values, 99) * 1e3:.0f} ms"


async def burst(server) -> tuple[dict[str, str], list[Outcome]]:
    """The greedy references one at a time (no batching), then every client at once."""
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    async with client:
        references = {prompt: await greedy_reference(client, prompt) for prompt in PROMPTS}
        clients = (stream_once(client, PROMPTS[i % len(PROMPTS)]) for i in range(NUM_CLIENTS))
        outcomes = await asyncio.wait_for(asyncio.gather(*clients), BURST_BOUND_S)
    return references, outcomes


async def hold_a_slot(http: httpx.AsyncClient, server, index: int) -> httpx.Response:
    """A long stream, admitted (its headers came back) and left open."""
    body = {
        "model": "tiny",
        "prompt": f"Holder {index}",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    request = http.build_request("POST", "/v1/completions", json=body, headers=server.headers)
    response = await http.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    return response


async def refusals_while_full(server) -> list[tuple[int, float]]:
    """(status, seconds) of NUM_PROBES lone requests, one after another, while every slot is held;
    the holders then leave (their requests are aborted)."""
    limits = httpx.Limits(max_connections=MAX_CONCURRENT + 2)
    async with httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        holders = await asyncio.gather(*(hold_a_slot(http, server, i) for i in range(MAX_CONCURRENT)))
        probes = []
        for _ in range(NUM_PROBES):
            started = time.monotonic()
            body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}
            answer = await http.post("/v1/completions", json=body, headers=server.headers)
            probes.append((answer.status_code, time.monotonic() - started))
        await asyncio.gather(*(holder.aclose() for holder in holders))
    return probes


def report(admitted: list[Outcome], refused: list[Outcome], wall_s: float) -> None:
    print(
        f"\noverload: {NUM_CLIENTS} streaming clients at once, --max-concurrent-requests {MAX_CONCURRENT}: "
        f"{len(admitted)} admitted, {len(refused)} refused (429), burst {wall_s:.1f} s"
    )
    print(
        f"  admitted: TTFT {spread([o.first_token_s for o in admitted])}; total {spread([o.total_s for o in admitted])}"
    )
    if refused:
        refusals = [o.total_s for o in refused]
        print(f"  refused in the burst: 429 in {spread(refusals)}, max {max(refusals) * 1e3:.0f} ms")


def test_256_streams_against_128_admitted_are_served_whole_or_refused_at_once(start_tiny_server):
    server = start_tiny_server("--max-concurrent-requests", str(MAX_CONCURRENT), name="overload")
    started = time.monotonic()
    references, outcomes = asyncio.run(burst(server))
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    report(admitted, refused, time.monotonic() - started)

    others = [(o.status, o.error) for o in outcomes if o.status not in (200, 429)]
    assert not others, others[:5]
    assert len(admitted) + len(refused) == NUM_CLIENTS
    # A refusal means the limit was reached: at least that many were admitted.
    assert len(admitted) >= MAX_CONCURRENT and len(refused) > 0
    assert all(o.finish_reason in ("length", "stop") for o in admitted)
    wrong = [(o.prompt, o.text) for o in admitted if o.text != references[o.prompt]]
    assert not wrong, wrong[:3]
    # The limit held: a client past the 128th was admitted only into a slot that an ended stream had
    # freed (a stream may end while the burst is still being read: the router validates 256 requests
    # in 0.6-1 s on two cores, and the first streams can finish their tokens in 0.4 s). Promptness
    # of a refusal is timed alone, below.
    last_refusal = max(o.total_s for o in refused)
    freed = sum(o.total_s < last_refusal for o in admitted)
    assert len(admitted) <= MAX_CONCURRENT + freed, (len(admitted), freed)

    probes = asyncio.run(asyncio.wait_for(refusals_while_full(server), BURST_BOUND_S))
    times = [seconds for _, seconds in probes]
    print(f"  refused alone while full: 429 in {spread(times)}, max {max(times) * 1e3:.0f} ms")
    assert [status for status, _ in probes] == [429] * NUM_PROBES
    assert max(times) < REFUSAL_BOUND_S

    assert_still_serving(server)


def assert_still_serving(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    answer = httpx.post(
        f"{server.url}/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
        headers=server.headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    gauges = server.wait_until_idle()
    assert gauges["tgserve_kv_cache_free_blocks"] == gauges["tgserve_kv_cache_total_blocks"]
    assert gauges["tgserve_requests_in_flight"] == 0
