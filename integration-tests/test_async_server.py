"""`tgserve serve --async-scheduling true` (the default on GPUs) on CPU: the engine schedules each
step before reading the last one's tokens, and clients see exactly what the synchronous server
gives them: greedy and seeded tokens, stop strings found downstream, concurrent requests, streams
cut off by the client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

PROMPTS = ["Hello! How are you today?", "The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def async_server(start_server, tiny_model):
    return start_server(["--model-id", tiny_model, "--async-scheduling", "true"], name="async")


def generate(server, prompt: str, **parameters) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True, **parameters}}
    response = httpx.post(f"{server.url}/generate", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("parameters", [{}, {"do_sample": True, "seed": 11, "temperature": 0.8}])
def test_tokens_equal_the_synchronous_servers(async_server, tiny_server, parameters):
    for prompt in PROMPTS:
        got, expected = (
            generate(async_server, prompt, **parameters),
            generate(tiny_server, prompt, **parameters),
        )
        assert got["generated_text"] == expected["generated_text"]
        assert got["details"]["finish_reason"] == expected["details"]["finish_reason"]


def test_a_stop_string_ends_the_request_as_on_the_synchronous_server(async_server, tiny_server):
    text = generate(tiny_server, PROMPTS[3])["generated_text"]
    stop = text.split()[2] if len(text.split()) > 2 else text[-3:]
    got = generate(async_server, PROMPTS[3], stop=[stop])
    assert got == generate(tiny_server, PROMPTS[3], stop=[stop])
    assert got["details"]["finish_reason"] == "stop_sequence"


def test_concurrent_streams_each_get_their_own_tokens(async_server, tiny_server):
    async def run(server) -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=server.api_key or "none", max_retries=0
        )

        async def one(prompt: str, max_tokens: int) -> str:
            stream = await client.completions.create(
                model="tgi", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

        return await asyncio.gather(*(one(p, 4 + 3 * i) for i, p in enumerate(PROMPTS * 2)))

    assert asyncio.run(run(async_server)) == asyncio.run(run(tiny_server))


def test_a_stream_cut_off_by_its_client_does_not_stop_the_others(async_server):
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 200}}
    with httpx.stream("POST", f"{async_server.url}/generate_stream", json=body, headers=async_server.headers,
                      timeout=60) as response:  # fmt: skip
        for _ in zip(range(3), response.iter_lines()):
            pass  # leave after a few events
    assert generate(async_server, PROMPTS[1])["details"]["generated_tokens"] == 12
