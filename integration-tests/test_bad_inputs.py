"""Bad requests get a 4xx naming the problem, never a 5xx, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 20  # well over --max-input-tokens=64
CASES = [
    # (path, raw body, expected status, words the message must contain)
    ("/generate", b"{not json", 422, "Invalid JSON"),
    ("/v1/completions", b"{not json", 400, "Invalid JSON"),
    ("/generate", b'{"inputs": ["a list"]}', 422, "inputs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/generate", b'{"inputs": "hi", "parameters": {"temperature": -1}}', 422, "temperature"),
    ("/generate", b'{"inputs": "hi", "parameters": {"top_p": 2.0, "do_sample": true}}', 422, "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 5}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 50}', 400, "--max-top-n-tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', 400, "--max-total-tokens"),
    ("/v1/completions", b'{"prompt": [100000000]}', 400, "vocabulary"),
    ("/generate", json.dumps({"inputs": LONG_PROMPT}).encode(), 422, "--max-input-tokens=64"),
    ("/v1/completions", json.dumps({"prompt": LONG_PROMPT}).encode(), 400, "--max-input-tokens=64"),
    (
        "/generate",
        json.dumps({"inputs": "hi", "parameters": {"stop": ["x"] * 10_000}}).encode(),
        422,
        "--max-stop-sequences",
    ),
    (
        "/v1/completions",
        json.dumps({"prompt": "hi", "stop": ["x"] * 10_000}).encode(),
        400,
        "--max-stop-sequences",
    ),
    ("/generate", b'{"inputs": "\xff\xfe broken"}', 422, "unicode"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400, "unicode"),
    ("/generate", b"", 422, "empty"),
    # Routes that read the body's keys before parsing it met Python's recursion limit (a 500).
    ("/tokenize", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 422, "recursion limit"),
    ("/invocations", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 422, "recursion limit"),
    # JSON numbers past a double's range parse as infinity: no sampling knob takes it.
    (
        "/generate",
        b'{"inputs": "hi", "parameters": {"temperature": 1e400, "do_sample": true}}',
        422,
        "finite",
    ),
    ("/generate", b'{"inputs": "hi", "parameters": {"repetition_penalty": 1e400}}', 422, "finite"),
    ("/v1/completions", b'{"prompt": "hi", "frequency_penalty": -1e400}', 400, "frequency_penalty"),
    # Integers past 64 bits could not be sent to the engine (a 500 from its message encoder).
    ("/generate_stream", b'{"inputs": "hi", "parameters": {"top_k": 76127592125291495424}}', 422, "top_k"),
    ("/v1/completions", b'{"prompt": "hi", "top_k": 76127592125291495424}', 400, "top_k"),
    ("/generate", b'{"inputs": "hi", "parameters": {"seed": 18446744073709551616}}', 422, "seed"),
]


def message_of(response: httpx.Response) -> str:
    error = response.json()["error"]
    return error["message"] if isinstance(error, dict) else error


@pytest.mark.parametrize(("path", "body", "status", "needle"), CASES)
def test_bad_input_is_a_4xx_naming_the_problem(tiny_server, path, body, status, needle):
    headers = {**tiny_server.headers, "content-type": "application/json"}
    response = httpx.post(f"{tiny_server.url}{path}", content=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    assert needle in message_of(response)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_a_body_not_sent_as_json_is_415(tiny_server, path, content_type):
    """A browser posts text/plain and form bodies from any page without a CORS preflight: a JSON body
    must say it is one (TGI and vLLM refuse the rest too)."""
    body = b'{"inputs": "Hi", "messages": [{"role": "user", "content": "Hi"}]}'
    headers = {**tiny_server.headers, **({"content-type": content_type} if content_type else {})}
    response = httpx.post(f"{tiny_server.url}{path}", content=body, headers=headers, timeout=30)
    assert response.status_code == 415, response.text
    assert "Content-Type: application/json" in message_of(response)
    charset = {**tiny_server.headers, "content-type": "application/json; charset=utf-8"}
    body = b'{"inputs": "Hi", "parameters": {"max_new_tokens": 1}}'
    assert (
        httpx.post(f"{tiny_server.url}/generate", content=body, headers=charset, timeout=30).status_code
        == 200
    )


def test_50mb_body_is_413(tiny_server):
    body = b'{"inputs": "' + b"a" * (50 << 20) + b'"}'
    headers = {**tiny_server.headers, "content-type": "application/json"}
    response = httpx.post(f"{tiny_server.url}/generate", content=body, headers=headers, timeout=120)
    assert response.status_code == 413
    assert "--payload-limit" in message_of(response)


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", "Basic whatever", "Token integration-secret"]
)
def test_missing_or_wrong_api_key_is_401(tiny_server, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    for path, body in (("/generate", {"inputs": "hi"}), ("/v1/completions", {"prompt": "hi"})):
        response = httpx.post(f"{tiny_server.url}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert "API key" in message_of(response)


def test_openai_client_sees_typed_errors(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=tiny_server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--max-input-tokens"):
        client.completions.create(model="tiny", prompt=LONG_PROMPT)
    wrong = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hi")


def test_server_still_serves_after_bad_inputs(tiny_server):
    response = httpx.post(
        f"{tiny_server.url}/generate",
        json={"inputs": "hi", "parameters": {"max_new_tokens": 3}},
        headers=tiny_server.headers,
        timeout=30,
    )
    assert response.status_code == 200
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
