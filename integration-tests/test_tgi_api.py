"""huggingface_hub's InferenceClient against the TGI routes: details, streaming, best_of."""

from __future__ import annotations

import pytest
from huggingface_hub import InferenceClient


@pytest.fixture(scope="module")
def client(tiny_server):
    return InferenceClient(model=tiny_server.url, token=tiny_server.api_key)


def test_text_generation_with_details(client):
    output = client.text_generation("The capital of France is", max_new_tokens=10, details=True)
    assert output.details.generated_tokens == len(output.details.tokens) > 0
    assert output.details.finish_reason in ("length", "eos_token")
    assert all(token.logprob is not None for token in output.details.tokens)
    assert output.generated_text == client.text_generation("The capital of France is", max_new_tokens=10)


def test_streaming_with_details(client):
    events = list(client.text_generation("Hello!", max_new_tokens=10, stream=True, details=True))
    assert all(event.generated_text is None for event in events[:-1])
    last = events[-1]
    assert last.details.generated_tokens == len(events)
    whole = client.text_generation("Hello!", max_new_tokens=10)
    assert last.generated_text == whole
    # POST / (TGI's compat route, which the client calls) returns the prompt too by default.
    assert "Hello!" + "".join(e.token.text for e in events if not e.token.special) == whole


def test_best_of_and_top_n_tokens(client):
    output = client.text_generation(
        "Once upon a time", max_new_tokens=6, details=True, best_of=2, do_sample=True, seed=3, top_n_tokens=2
    )
    assert len(output.details.best_of_sequences) == 1
    assert all(len(top) == 2 for top in output.details.top_tokens)


def test_return_full_text_and_stop(client):
    whole = client.text_generation("Water boils at", max_new_tokens=8, return_full_text=False)
    full = client.text_generation("Water boils at", max_new_tokens=8)  # TGI's POST / default
    assert full == "Water boils at" + whole
    assert client.text_generation("Water boils at", max_new_tokens=8, return_full_text=True) == full
    if len(whole) > 3:
        stop = whole[2:4]
        cut = client.text_generation(
            "Water boils at", max_new_tokens=8, stop=[stop], details=True, return_full_text=False
        )
        assert cut.generated_text == whole[: whole.index(stop) + len(stop)]  # TGI keeps the stop sequence
        assert cut.details.finish_reason == "stop_sequence"


def test_decoder_input_details_scores_the_prompt(client, tiny_model, offline_llm):
    from tgserve import SamplingParams

    prompt = "The capital of France is"
    output = client.text_generation(prompt, max_new_tokens=3, details=True, decoder_input_details=True)
    offline = offline_llm(tiny_model).generate([prompt], SamplingParams(max_new_tokens=1, prompt_logprobs=0))[
        0
    ]
    prefill = output.details.prefill
    assert [t.id for t in prefill] == offline.prompt_token_ids
    assert prefill[0].logprob is None
    assert [t.logprob for t in prefill[1:]] == pytest.approx(
        [e.logprob for e in offline.prompt_logprobs[1:]], abs=1e-4
    )


def test_sagemaker_invocations_and_chat_tokenize(tiny_server):
    import httpx

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    url, headers = tiny_server.url, tiny_server.headers
    chat = httpx.post(
        f"{url}/invocations", json={"messages": messages, "max_tokens": 4}, headers=headers, timeout=60
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    tgi = httpx.post(f"{url}/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
                     headers=headers, timeout=60)  # fmt: skip
    assert tgi.status_code == 200 and tgi.json()[0]["generated_text"].startswith("Hello")
    tokens = httpx.post(
        f"{url}/chat_tokenize", json={"messages": messages}, headers=headers, timeout=60
    ).json()
    assert "What is the capital of France?" in tokens["templated_text"]
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens["tokenize_response"])
