"""The official `openai` client against the tiny model: parity with the offline API, streaming, n, seeds."""

from __future__ import annotations

import asyncio

import openai
import pytest

PROMPTS = ["Hello! How are you today?", "The capital of France is", "def add(a, b):"]


@pytest.fixture(scope="module")
def offline(tiny_model, offline_llm):
    """Greedy reference outputs from the offline `LLM` API, in this process."""
    from tgserve import SamplingParams

    llm = offline_llm(tiny_model)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.0))
    return {prompt: output for prompt, output in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=tiny_server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def async_client(tiny_server):
    return openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key=tiny_server.api_key, max_retries=0)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_the_offline_api(tiny_server, offline, prompt):
    import httpx

    body = {"inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}}
    response = httpx.post(f"{tiny_server.url}/generate", json=body, headers=tiny_server.headers, timeout=60)
    assert response.status_code == 200, response.text
    tokens = [t["id"] for t in response.json()["details"]["tokens"]]
    assert tokens == offline[prompt].token_ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_sync_stream_and_not(client, offline, prompt):
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    assert whole.choices[0].text == offline[prompt].text
    assert whole.usage.completion_tokens == len(offline[prompt].token_ids)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == offline[prompt].text


def test_chat_async_stream_and_not(async_client):
    messages = [{"role": "user", "content": "Tell me a story"}]

    async def both():
        whole = await async_client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
        stream = await async_client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        return whole, chunks

    whole, chunks = asyncio.run(both())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_n_with_seed_is_different_and_reproducible(client):
    def sample():
        response = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, n=3, seed=1234, temperature=1.0
        )
        return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]

    first = sample()
    assert len(set(first)) == 3
    assert sample() == first


def test_logprobs_and_stop(client):
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    text = response.choices[0].message.content
    if len(text) > 2:  # stop at the text's third character: the output ends just before it
        cut = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=0,
            stop=[text[2:4]],
        )
        assert cut.choices[0].message.content == text[: text.index(text[2:4])]
        assert cut.choices[0].finish_reason == "stop"


def test_models_route(client):
    assert len(client.models.list().data) == 1


@pytest.fixture(scope="module")
def offline_prompt_logprobs(tiny_model, offline_llm):
    from tgserve import SamplingParams

    scored = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=2)
    output = offline_llm(tiny_model).generate([PROMPTS[1]], scored)[0]
    return output.prompt_token_ids, output.prompt_logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_echo_scores_the_prompt(client, offline_prompt_logprobs, stream):
    prompt_ids, expected = offline_prompt_logprobs
    kwargs = dict(model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, logprobs=2)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        logprobs = chunks[0].choices[0].logprobs  # the echo comes with the first chunk
        assert chunks[0].choices[0].text.startswith(PROMPTS[1])
    else:
        response = client.completions.create(**kwargs)
        logprobs = response.choices[0].logprobs
        assert len(logprobs.token_logprobs) == len(prompt_ids) + 3
    head = logprobs.token_logprobs[: len(prompt_ids)]
    assert head[0] is None and logprobs.top_logprobs[0] is None
    assert head[1:] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-4)
    # Keyed by token text, so two alternatives that print alike share an entry.
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1 : len(prompt_ids)])
