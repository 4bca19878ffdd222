"""The server side of the benchmark: streaming /v1/completions requests under a concurrency cap."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from tgserve.router.bench.report import RequestTiming
from tgserve.router.bench.workload import arrival_delays


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def tokenize_remote(url: str, api_key: str | None):
    """A tokenize function backed by the server's vLLM-shaped /tokenize (so prompts match its tokenizer)."""
    client = httpx.Client(base_url=url, headers=headers(api_key), timeout=60)

    def tokenize(text: str) -> list[int]:
        response = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        return response.json()["tokens"]

    return tokenize


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> RequestTiming:
    """Stream one completion; each SSE chunk with text or a finish reason counts as output arriving."""
    timing = RequestTiming(prompt_len=len(prompt))
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = str(chunk["error"])
                    return timing
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter() - start
                    timing.ttft = now if timing.ttft is None else timing.ttft
                    timing.token_times.append(now)
        timing.latency = time.perf_counter() - start
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def run_load(
    url: str,
    api_key: str | None,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    request_rate: float,
    seed: int,
) -> tuple[list[RequestTiming], float]:
    """All prompts, at most `concurrency` in flight; returns the timings and the wall time."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    semaphore = asyncio.Semaphore(concurrency)
    delays = arrival_delays(random.Random(seed), len(prompts), request_rate)
    async with httpx.AsyncClient(
        base_url=url, headers=headers(api_key), limits=limits, timeout=None
    ) as client:

        async def limited(prompt: list[int]) -> RequestTiming:
            async with semaphore:
                return await one_request(client, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, delay in zip(prompts, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(prompt)))
        timings = await asyncio.gather(*tasks)
        return list(timings), time.perf_counter() - start
