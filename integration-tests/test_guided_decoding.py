"""Structured output through the real server and SmolLM2: OpenAI's `response_format` with the
official client (streamed and not, the same text for a seed), TGI's `grammar`, and the 4xx a
grammar that cannot be used gets."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"enum": ["France", "Germany", "Italy"]},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["city", "country", "landmarks"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Name a European capital and two of its landmarks, as JSON."}]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_streamed_and_not_give_the_same_valid_text(client, seed):
    args = dict(model="default", messages=MESSAGES, max_tokens=100, temperature=0.9, seed=seed)
    whole = client.chat.completions.create(response_format=RESPONSE_FORMAT, **args)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    stream = client.chat.completions.create(response_format=RESPONSE_FORMAT, stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_fifty_sampled_completions_all_follow_the_schema(client):
    """Nested objects, an enum, an array with bounds, required fields: 50 samples at temperature 1."""

    def ten(seed: int) -> list[tuple[str, str]]:  # n is at most --max-n (16) a request
        completion = client.chat.completions.create(
            model="default", messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=100,
            temperature=1.0, seed=seed, n=10,
        )  # fmt: skip
        return [(c.message.content, c.finish_reason) for c in completion.choices]

    with ThreadPoolExecutor(5) as pool:  # at once: the engine batches all fifty
        texts = [t for batch in pool.map(ten, range(5)) for t in batch]
    assert len(texts) == 50
    for text, reason in texts:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_32_guided_beside_32_unguided_leave_the_unguided_unchanged(client):
    """One batch of 32 schema-guided and 32 unguided requests: every guided answer valid, and each
    unguided one token for token what it is without guided neighbours (greedy, float32)."""
    small = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # llguidance's compact JSON: no rambling whitespace
    }
    guided_format = {"type": "json_schema", "json_schema": {"name": "reply", "schema": small, "strict": True}}
    questions = [f"Is {n} a prime number? Say why." for n in range(2, 34)]

    def unguided(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model="default", messages=messages, max_tokens=12, temperature=0
        )
        return reply.choices[0].message.content

    def guided(question: str) -> tuple[str, str]:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model="default", messages=messages, response_format=guided_format, max_tokens=100, temperature=1.0
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(64) as pool:
        alone = list(pool.map(unguided, questions))
        mixed = [pool.submit(guided, q) for q in questions] + [pool.submit(unguided, q) for q in questions]
        results = [future.result() for future in mixed]
    for text, reason in results[:32]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), small)
    assert results[32:] == alone


def test_the_client_parses_into_a_pydantic_model(client):
    class Answer(BaseModel):
        capital: str
        population_millions: int

    completion = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France? Reply as JSON."}],
        response_format=Answer,
        max_tokens=60,
        temperature=0,
    )
    answer = completion.choices[0].message.parsed
    assert isinstance(answer, Answer) and answer.capital


def test_json_object_on_completions(client):
    completion = client.completions.create(
        model="default",
        prompt='A cat as JSON: {"name": "Tom", "age": 3}\nA dog as JSON:',
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_an_unusable_schema_is_a_400_that_names_it(client):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=MESSAGES, response_format=bad, max_tokens=4)
    assert "uniqueItems" in caught.value.message and caught.value.body["param"] == "response_format"


def tgi(server, path: str, grammar: dict, **parameters) -> httpx.Response:
    body = {"inputs": "The date of the first moon landing:", "parameters": {"grammar": grammar, **parameters}}
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


def test_tgi_regex_grammar_on_generate_and_post_root(smol_server):
    response = tgi(smol_server, "/generate", {"type": "regex", "value": DATE}, max_new_tokens=16)
    assert response.status_code == 200, response.text
    assert re.fullmatch(DATE, response.json()["generated_text"])
    response = tgi(
        smol_server, "/", {"type": "regex", "value": DATE}, max_new_tokens=16, return_full_text=False
    )
    assert response.status_code == 200, response.text
    assert re.fullmatch(DATE, response.json()[0]["generated_text"])


def test_tgi_json_grammar_streamed(smol_server):
    schema = {
        "type": "object",
        "properties": {"year": {"type": "integer"}},
        "required": ["year"],
        "additionalProperties": False,
    }
    grammar = {"type": "json", "value": schema}
    response = tgi(smol_server, "/generate_stream", grammar, max_new_tokens=24, details=True)
    assert response.status_code == 200, response.text
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    jsonschema.validate(json.loads(events[-1]["generated_text"]), schema)
    assert events[-1]["details"]["finish_reason"] == "eos_token"


def test_tgi_bad_regex_is_a_422(smol_server):
    response = tgi(smol_server, "/generate", {"type": "regex", "value": "(("}, max_new_tokens=4)
    assert response.status_code == 422
    assert "regular expression" in response.json()["error"] and response.json()["error_type"] == "validation"


# ---- the other grammar library ----------------------------------------------------------------


@pytest.fixture(scope="module")
def xgrammar_server(start_server):
    return start_server(["--guided-decoding-backend", "xgrammar"], name="smollm2-xgrammar")


def test_with_xgrammar_sampled_completions_follow_the_schema_and_regex_grammars_match(xgrammar_server):
    client = openai.OpenAI(base_url=f"{xgrammar_server.url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(
        model="default", messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=100,
        temperature=1.0, seed=3, n=8,
    )  # fmt: skip
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    response = tgi(xgrammar_server, "/generate", {"type": "regex", "value": DATE}, max_new_tokens=16)
    assert response.status_code == 200, response.text
    assert re.fullmatch(DATE, response.json()["generated_text"])
