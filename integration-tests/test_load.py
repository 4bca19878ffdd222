"""64 concurrent streams arrive whole; aborting half of them mid-stream frees every KV block."""

from __future__ import annotations

import asyncio

import httpx
import openai

NUM_CLIENTS = 64


def test_64_concurrent_streams_are_complete_and_uncorrupted(tiny_server):
    client = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key=tiny_server.api_key, max_retries=0)
    prompts = [f"Request number {i}: tell me about the village" for i in range(NUM_CLIENTS)]

    async def reference(prompt: str) -> str:
        response = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        return response.choices[0].text

    async def streamed(prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run():
        expected = [await reference(p) for p in prompts[:8]]  # one at a time: no batching effects
        results = await asyncio.gather(*(streamed(p) for p in prompts))
        return expected, results

    expected, results = asyncio.run(run())
    assert all(reason in ("length", "stop") for _, reason in results)
    assert [text for text, _ in results[:8]] == expected
    assert tiny_server.wait_until_idle()["tgserve_kv_cache_free_blocks"] > 0


def test_aborting_half_mid_stream_frees_every_block(tiny_server):
    body = {"model": "tiny", "max_tokens": 180, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = tiny_server.headers

    async def one(client: httpx.AsyncClient, index: int) -> int:
        request = {**body, "prompt": f"Story {index}: once upon a time"}
        chunks = 0
        async with client.stream("POST", "/v1/completions", json=request, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if index % 2 == 0 and chunks == 3:
                    return chunks  # leaving the block closes the connection mid-stream
        return chunks

    async def run():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    counts = asyncio.run(run())
    assert all(c == 3 for c in counts[::2])
    assert all(c > 100 for c in counts[1::2])  # the other half ran to the end
    gauges = tiny_server.wait_until_idle()
    assert gauges["tgserve_kv_cache_free_blocks"] == gauges["tgserve_kv_cache_total_blocks"]
    assert gauges["tgi_batch_current_size"] == 0
    failures = tiny_server.gauges()
    assert failures["tgi_request_count"] >= NUM_CLIENTS
