"""The default model (SmolLM2-135M-Instruct, no --model-id): a real answer, and parity with the
offline API. The server (`smol_server`) is the session's."""

from __future__ import annotations

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)


def test_capital_of_france_is_paris(client):
    response = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
        temperature=0,
    )
    assert "Paris" in response.choices[0].message.content


def test_greedy_tokens_equal_the_offline_api(smol_server, client, offline_llm):
    from tgserve import SamplingParams

    offline = offline_llm().generate([PROMPT], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    response = httpx.post(
        f"{smol_server.url}/generate",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}},
        timeout=120,
    )
    assert [t["id"] for t in response.json()["details"]["tokens"]] == offline.token_ids
    completion = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
    assert completion.choices[0].text == offline.text


def test_inference_client_stream(smol_server):
    client = InferenceClient(model=smol_server.url)
    events = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert events[-1].details.generated_tokens == len(events)
    assert "Paris" in events[-1].generated_text


def test_models_lists_the_default_model(client):
    assert client.models.list().data[0].id == "HuggingFaceTB/SmolLM2-135M-Instruct"
