"""The HTTP layer against an in-process fake engine: response shapes, errors, limits, auth."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx
import pytest

from tgserve.router.app import create_app
from tgserve.router.config import RouterConfig
from tgserve.router.tests.fakes import FakeEngineClient, make_state, text_script
from tgserve.router.tokenization import RouterTokenizer

pytestmark = pytest.mark.anyio
ANSWER = " The capital of France is Paris. It is a city."


@pytest.fixture
def anyio_backend():
    return "asyncio"


def fake_app(tokenizer_dir, tokenizer, config=None, tick_s=0.001):
    """The app around a fake engine that answers ANSWER, one token a tick."""
    eos = tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    client = FakeEngineClient(text_script(tokenizer, ANSWER, eos), eos, tick_s)
    state = make_state(tokenizer_dir, client, config)
    return client, state, create_app(state)


def http_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def build(tokenizer_dir, tokenizer, config=None, tick_s=0.001):
    client, _, app = fake_app(tokenizer_dir, tokenizer, config, tick_s)
    return client, http_client(app)


def events(body: str) -> list[object]:
    out = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_tgi_generate_with_details(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer)
    response = await http.post(
        "/generate", json={"inputs": "Q:", "parameters": {"details": True, "top_n_tokens": 2}}
    )
    body = response.json()
    assert response.status_code == 200, body
    assert body["generated_text"] == ANSWER
    details = body["details"]
    assert details["finish_reason"] == "eos_token"
    assert details["generated_tokens"] == len(details["tokens"])
    assert details["tokens"][-1]["special"] is True
    assert len(details["top_tokens"][0]) == 2


async def test_tgi_generate_reports_its_durations_in_headers(tokenizer_dir, tokenizer, caplog):
    """TGI's x-* headers and log line: sizes, and durations equal to what the request metrics
    recorded. The fake engine schedules a request 30 ms after it arrives, then gives it a token
    every 10 ms."""
    caplog.set_level(logging.INFO, logger="tgserve.router")
    config = RouterConfig(compute_type="gpu+optimized")
    client, state, app = fake_app(tokenizer_dir, tokenizer, config, tick_s=0.01)
    client.queue_s = 0.03
    http = http_client(app)
    response = await http.post("/generate", json={"inputs": "Q: France?", "parameters": {"details": True}})
    assert response.status_code == 200, response.text
    headers = response.headers
    assert headers["x-compute-type"] == "gpu+optimized"
    assert headers["x-compute-characters"] == str(len("Q: France?"))
    assert headers["x-prompt-tokens"] == str(len(tokenizer.encode("Q: France?")))
    assert headers["x-generated-tokens"] == str(response.json()["details"]["generated_tokens"])
    total, inference = int(headers["x-total-time"]), int(headers["x-inference-time"])
    queue, per_token = int(headers["x-queue-time"]), int(headers["x-time-per-token"])
    generated = int(headers["x-generated-tokens"])
    assert 29 <= queue < 30 + 10 * generated, "scheduled after 30 ms, before the first token"
    assert inference >= generated * 10 - 1, "a token every 10 ms from the schedule"
    assert total >= queue + inference > inference > per_token >= 9
    assert int(headers["x-validation-time"]) <= total
    assert abs(float(headers["x-compute-time"]) * 1000 - total) < 1
    recorded = {
        name: state.metrics.registry.get_sample_value(f"tgi_request_{name}_duration_sum")
        for name in ("queue", "inference", "mean_time_per_token")
    }
    assert int(recorded["queue"] * 1000) == queue
    assert int(recorded["inference"] * 1000) == inference
    assert int(recorded["mean_time_per_token"] * 1000) == per_token
    recorded_total = state.metrics.registry.get_sample_value("tgi_request_duration_sum")
    recorded_validation = state.metrics.registry.get_sample_value("tgi_request_validation_duration_sum")
    asked = state.metrics.registry.get_sample_value("tgi_request_max_new_tokens_sum")
    assert asked == client.submitted[0][2].max_new_tokens
    prefill = state.metrics.registry.get_sample_value("tgserve_request_prefill_seconds_sum")
    assert 0.009 <= prefill <= inference / 1000, "the first token comes a tick after the schedule"
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("success:")]
    assert logged == [
        f"success: prompt_tokens={headers['x-prompt-tokens']} generated_tokens={generated} "
        f"total_time={recorded_total:.3f}s validation_time={recorded_validation * 1e3:.1f}ms "
        f"queue_time={recorded['queue'] * 1e3:.1f}ms inference_time={recorded['inference']:.3f}s "
        f"time_per_token={recorded['mean_time_per_token'] * 1e3:.1f}ms finish=eos_token"
    ]
    stream = await http.post("/generate_stream", json={"inputs": "Q:"})
    assert stream.headers["x-compute-type"] == "gpu+optimized"
    assert stream.headers["x-compute-characters"] == "2"


async def test_tgi_stream_and_compat_route(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer)
    response = await http.post("/generate_stream", json={"inputs": "Q:", "parameters": {"stop": ["."]}})
    stream = events(response.text)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(e["generated_text"] is None for e in stream[:-1])
    assert stream[-1]["generated_text"] == " The capital of France is Paris."
    # TGI's POST / returns the prompt too unless told otherwise (a text-generation model's default).
    compat = await http.post("/", json={"inputs": "Q:", "parameters": {"max_new_tokens": 3}})
    assert isinstance(compat.json(), list) and compat.json()[0]["generated_text"].startswith("Q: The")
    compat_stream = await http.post("/", json={"inputs": "Q:", "stream": True})
    assert events(compat_stream.text)[-1]["generated_text"] == "Q:" + ANSWER
    told = await http.post(
        "/", json={"inputs": "Q:", "stream": True, "parameters": {"return_full_text": False}}
    )
    assert events(told.text)[-1]["generated_text"] == ANSWER
    assert (await http.get("/")).status_code == 200  # TGI's GET / is a health check


async def test_openai_completions_n_seed_and_stop(tokenizer_dir, tokenizer):
    client, http = build(tokenizer_dir, tokenizer)
    body = {"prompt": "Q:", "n": 3, "seed": 7, "stop": ["."], "max_tokens": 50, "logprobs": 1}
    response = await http.post("/v1/completions", json=body)
    data = response.json()
    assert response.status_code == 200, data
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(
        c["text"] == " The capital of France is Paris" and c["finish_reason"] == "stop"
        for c in data["choices"]
    )
    assert sorted(p.seed for _, _, p in client.submitted) == [7, 8, 9]
    assert data["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in data["choices"])
    assert len(client.finished) == 3  # the router told the engine to stop at the stop string


async def test_openai_chat_stream_with_usage(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = events((await http.post("/v1/chat/completions", json=body)).text)
    assert stream[-1] == "[DONE]"
    assert stream[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in stream[1:-2])
    assert text == ANSWER
    assert stream[-3]["choices"][0]["finish_reason"] == "stop"
    assert stream[-2]["choices"] == [] and stream[-2]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/generate", b"{bad json", 422, "Invalid JSON"),
        ("/generate", b'{"inputs": 3}', 422, "inputs"),
        ("/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": "3"}}', 422, "max_new_tokens"),
        ("/generate", b'{"inputs": "\xff"}', 422, "unicode"),
        ("/generate", b"", 422, "empty"),
        # Out of range whether or not the request samples: a greedy one drops its warpers.
        ("/generate", b'{"inputs": "x", "parameters": {"top_p": 1.5}}', 422, "top_p"),
        ("/generate", b'{"inputs": "x", "parameters": {"do_sample": true, "top_p": 0}}', 422, "top_p"),
        ("/generate", b'{"inputs": "x", "parameters": {"typical_p": 7}}', 422, "typical_p"),
        ("/generate", b'{"inputs": "x", "parameters": {"repetition_penalty": 0}}', 422, "repetition_penalty"),
        ("/generate", b'{"inputs": "x", "parameters": {"frequency_penalty": -3}}', 422, "frequency_penalty"),
        ("/v1/completions", b'{"prompt": "x", "temperature": 3}', 400, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "--max-total-tokens"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}',
            400,
            "--max-stop-sequences",
        ),
    ],
)
async def test_bad_inputs_are_4xx_naming_the_problem(tokenizer_dir, tokenizer, path, body, status, needle):
    _, http = build(tokenizer_dir, tokenizer)
    response = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert needle in message


async def test_bodies_not_sent_as_json_are_415_in_each_apis_shape(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer)
    plain = {"content-type": "text/plain"}
    tgi = await http.post("/generate", content=b'{"inputs": "Q:"}', headers=plain)
    assert tgi.status_code == 415 and tgi.json()["error_type"] == "unsupported_media_type"
    assert "not text/plain" in tgi.json()["error"]
    chat = b'{"messages": [{"role": "user", "content": "Q"}]}'
    openai = await http.post("/v1/chat/completions", content=chat)  # no Content-Type at all
    assert openai.status_code == 415 and openai.json()["error"]["type"] == "invalid_request_error"
    assert "this request has no Content-Type" in openai.json()["error"]["message"]
    sent = {"content-type": "application/json; charset=utf-8"}
    assert (await http.post("/v1/chat/completions", content=chat, headers=sent)).status_code == 200


async def test_sagemaker_invocations_answer_as_the_bodys_own_route(tokenizer_dir, tokenizer):
    """TGI's /invocations: chat, completion or TGI body, each answered as its own route would."""
    _, http = build(tokenizer_dir, tokenizer)
    chat = await http.post("/invocations", json={"messages": [{"role": "user", "content": "Q"}]})
    assert chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"]["content"] == ANSWER
    completion = await http.post("/invocations", json={"prompt": "Q:", "max_tokens": 3})
    assert completion.json()["object"] == "text_completion"
    tgi = await http.post("/invocations", json={"inputs": "Q:"})
    assert tgi.json()[0]["generated_text"] == "Q:" + ANSWER  # as POST /
    streamed = await http.post(
        "/invocations", json={"messages": [{"role": "user", "content": "Q"}], "stream": True}
    )
    assert events(streamed.text)[-1] == "[DONE]"
    bad = await http.post("/invocations", json={"inputs": ""})
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"


async def test_openapi_documents_the_request_bodies(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer)
    spec = (await http.get("/openapi.json")).json()
    components = spec["components"]["schemas"]

    def body_of(path: str) -> dict:
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return components[ref.rsplit("/", 1)[1]]

    assert "inputs" in body_of("/generate")["properties"]
    assert "messages" in body_of("/v1/chat/completions")["required"]
    assert "max_new_tokens" in components["TGIParameters"]["properties"]
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec))
    assert refs and all(name in components for name in refs)  # every reference resolves


async def test_unknown_routes_and_methods_answer_in_each_apis_shape(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer)
    missing = await http.post("/v1/embeddings", json={"input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert "/v1/embeddings" in missing.json()["error"]["message"]
    wrong = await http.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    assert wrong.headers["allow"] == "POST"
    tgi = await http.get("/generate")
    assert tgi.status_code == 405 and tgi.json()["error_type"] == "method_not_allowed"
    both = await http.options("/")  # GET / is the probe, POST / TGI's generate
    assert both.status_code == 405 and both.headers["allow"] == "GET, POST"


async def test_openapi_documents_every_response(tokenizer_dir, tokenizer):
    """What a fuzzer checks every response against (make reliability): each route's errors in its
    family's shape, its event streams, and the bodies that are not JSON."""
    _, http = build(tokenizer_dir, tokenizer)
    paths = (await http.get("/openapi.json")).json()["paths"]
    generate = paths["/generate"]["post"]["responses"]
    assert {"401", "413", "415", "422", "424", "429", "503"} <= set(generate)
    assert generate["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/TGIError")
    completions = paths["/v1/completions"]["post"]["responses"]
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIError")
    assert "text/event-stream" in completions["200"]["content"]
    assert "text/event-stream" in paths["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty body
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    tokenize = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(tokenize["anyOf"]) == 3  # TGI's inputs, vLLM's prompt or messages


async def test_openapi_states_what_bodies_the_server_takes(tokenizer_dir, tokenizer):
    """The schema a fuzzer generates bodies from: no empty prompt, null for any optional OpenAI
    field (read as not given) but not for a required one, and streams as server-sent events."""
    _, http = build(tokenizer_dir, tokenizer)
    document = (await http.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    assert schemas["TGIRequest"]["properties"]["inputs"]["minLength"] == 1
    completion = schemas["CompletionRequest"]["properties"]
    prompt_forms = completion["prompt"]["anyOf"]
    assert all(form.get("minLength") == 1 or form.get("minItems") == 1 for form in prompt_forms)
    assert {"type": "null"} in completion["n"]["anyOf"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert {"type": "null"} not in schemas["ChatCompletionRequest"]["properties"]["messages"].get("anyOf", [])
    stream = document["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert stream["schema"]["properties"]["data"] == {"type": "string"}


async def test_decoder_input_details_alone_brings_the_details(tokenizer_dir, tokenizer):
    """As TGI: asking for the prompt's details is asking for details."""
    _, http = build(tokenizer_dir, tokenizer)
    body = {"inputs": "Q:", "parameters": {"decoder_input_details": True, "max_new_tokens": 2}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert details["prefill"] and details["prefill"][0]["logprob"] is None


async def test_openai_nulls_mean_not_given(tokenizer_dir, tokenizer):
    """The SDK sends null for an optional argument passed as None; OpenAI's schema allows it."""
    _, http = build(tokenizer_dir, tokenizer)
    nulls = {"n": None, "stream": None, "logprobs": None, "stream_options": None, "seed": None}
    completion = await http.post(
        "/v1/completions", json={"prompt": "Q:", "echo": None, "max_tokens": None, **nulls}
    )
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"]) == 1
    assert completion.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for max_tokens
    messages = [{"role": "user", "content": "Q"}]
    chat = await http.post("/v1/chat/completions", json={"messages": messages, "top_logprobs": None, **nulls})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(("seed", "ok"), [(-1, True), (-(2**63), True), (2**64 - 1, True), (2**64, False)])
async def test_seeds_take_the_signed_and_the_unsigned_64_bit_range(tokenizer_dir, tokenizer, seed, ok):
    """vLLM takes signed 64-bit seeds and TGI unsigned ones; a random u64 must not fail half the time."""
    client, http = build(tokenizer_dir, tokenizer)
    body = {"prompt": "Q:", "seed": seed, "temperature": 1.0, "max_tokens": 2}
    response = await http.post("/v1/completions", json=body)
    assert (response.status_code == 200) == ok, response.text
    if ok:
        assert 0 <= client.submitted[0][2].seed < 2**64
    else:
        assert "64-bit" in response.json()["error"]["message"]


async def test_engine_rejection_is_a_validation_error(tokenizer_dir, tokenizer):
    client, http = build(tokenizer_dir, tokenizer)
    client.reject_with = "prompt too long for the KV cache"
    response = await http.post("/generate", json={"inputs": "x"})
    assert response.status_code == 422 and "KV cache" in response.json()["error"]


async def test_over_the_concurrency_limit_is_429(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer, RouterConfig(max_concurrent_requests=1), tick_s=0.02)
    first = asyncio.create_task(http.post("/generate", json={"inputs": "x"}))
    await asyncio.sleep(0.05)
    second = await http.post("/generate", json={"inputs": "x"})
    assert second.status_code == 429 and "--max-concurrent-requests=1" in second.json()["error"]
    assert (await first).status_code == 200
    assert (await http.post("/generate", json={"inputs": "x"})).status_code == 200


async def hang_up_after(app, path: str, body: dict, after_s: float) -> list[dict]:
    """Call the app as a client that sends its request and closes the connection `after_s` later,
    before any answer (httpx's ASGI transport cannot: it disconnects only after the response)."""
    payload = json.dumps(body).encode()
    headers = [
        (b"host", b"test"),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(payload)),
    ]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": headers, "client": ("127.0.0.1", 1), "server": ("test", 80),
    }  # fmt: skip
    requests = [{"type": "http.request", "body": payload, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await asyncio.sleep(after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize(
    ("path", "body"), [("/generate", {"inputs": "x"}), ("/v1/completions", {"prompt": "x", "max_tokens": 50})]
)
async def test_a_client_that_hangs_up_is_aborted_in_the_engine(tokenizer_dir, tokenizer, path, body):
    """A non-streaming request stops in the engine as soon as its client goes, not at its end."""
    client, state, app = fake_app(tokenizer_dir, tokenizer, tick_s=0.05)  # the answer takes ~0.6 s
    sent = await hang_up_after(app, path, body, after_s=0.15)
    assert len(client.submitted) == 1
    assert client.aborted == [client.submitted[0][0]] and not client.finished
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    sample = state.metrics.registry.get_sample_value
    assert sample("tgi_request_failure_total", {"err": "aborted"}) == 1
    assert sample("tgi_request_success_total") == 0


async def test_api_key(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer, RouterConfig(api_key="secret"))
    missing = await http.post("/v1/completions", json={"prompt": "x"})
    wrong = await http.post("/generate", json={"inputs": "x"}, headers={"Authorization": "Bearer nope"})
    right = await http.post("/generate", json={"inputs": "x"}, headers={"Authorization": "Bearer secret"})
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
    assert "missing" in missing.json()["error"]["message"] and "wrong" in wrong.json()["error"]
    lowercase = await http.post("/generate", json={"inputs": "x"}, headers={"Authorization": "bearer secret"})
    assert lowercase.status_code == 200  # the scheme is case-insensitive
    assert (await http.get("/health")).status_code == 200


async def test_body_size_limit(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer, RouterConfig(payload_limit=1000))
    response = await http.post("/generate", json={"inputs": "x" * 2000})
    assert response.status_code == 413 and "--payload-limit=1000" in response.json()["error"]


async def test_engine_death_ends_requests_with_errors(tokenizer_dir, tokenizer):
    client, http = build(tokenizer_dir, tokenizer, tick_s=0.05)
    stream = asyncio.create_task(
        http.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 50})
    )
    blocking = asyncio.create_task(http.post("/generate", json={"inputs": "x"}))
    await asyncio.sleep(0.12)
    client.fail("killed")
    stream_events = events((await stream).text)
    assert "killed" in stream_events[-2]["error"]["message"] and stream_events[-1] == "[DONE]"
    assert (await blocking).status_code == 503
    assert (await http.get("/health")).status_code == 503
    assert (await http.post("/generate", json={"inputs": "x"})).status_code == 503


async def test_service_routes(tokenizer_dir, tokenizer):
    _, http = build(tokenizer_dir, tokenizer)
    info = (await http.get("/info")).json()
    assert info["max_total_tokens"] == 256 and info["max_servable_tokens"] == 256 and "kv_cache_dtype" in info
    assert (await http.get("/v1/models")).json()["data"][0]["id"] == "tiny"
    tgi = (await http.post("/tokenize", json={"inputs": "Hello world"})).json()
    assert "".join(t["text"] for t in tgi) == "Hello world"
    vllm = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert vllm["tokens"] == [t["id"] for t in tgi] and vllm["count"] == len(tgi)
    assert (await http.post("/detokenize", json={"tokens": vllm["tokens"]})).json()["prompt"] == "Hello world"
    messages = [{"role": "user", "content": "Hello world"}]
    chat = (await http.post("/chat_tokenize", json={"messages": messages})).json()
    assert chat["templated_text"].endswith("<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n")
    chat_ids = (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
    assert [t["id"] for t in chat["tokenize_response"]] == chat_ids  # what the chat route sends
    assert "".join(t["text"] for t in chat["tokenize_response"]) == chat["templated_text"]
    # The chat route's checks of the sampling fields hold here too (a TGI route: its 422).
    for refused in (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"logprobs": True, "top_logprobs": 6},  # over --max-top-n-tokens (5)
        {"stop": ["a", "b", "c", "d", "e"]},  # over --max-stop-sequences (4)
        {"stop_token_ids": [10**6]},  # not in the vocabulary
        {"max_completion_tokens": 256},  # no room for a prompt under --max-total-tokens (256)
    ):
        answer = await http.post("/chat_tokenize", json={"messages": messages, **refused})
        assert answer.status_code == 422 and answer.json()["error"], (refused, answer.text)
    await http.post("/generate", json={"inputs": "x"})
    metrics = (await http.get("/metrics")).text
    assert "tgi_request_success 1.0" in metrics.splitlines()


async def test_openapi_states_the_rules_the_server_enforces(tokenizer_dir, tokenizer):
    """Bodies a schema-driven client may build are the ones the server takes: the rules it can state
    (non-empty prompts, token ids in the vocabulary, tool_choice with tools, no watermark, one of a
    shaped route's keys) are in /openapi.json, checked here with a JSON Schema validator."""
    jsonschema = pytest.importorskip("jsonschema")  # a test dependency of the main environment only

    _, state, app = fake_app(tokenizer_dir, tokenizer)
    document = (await http_client(app).get("/openapi.json")).json()
    vocab = RouterTokenizer.from_directory(tokenizer_dir).vocab_size

    def valid(path: str, body: object) -> bool:
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator({**schema, "components": document["components"]})
        return validator.is_valid(body)

    assert valid("/detokenize", {"tokens": [0, vocab - 1]})
    assert not valid("/detokenize", {"tokens": [-1]}) and not valid("/detokenize", {"tokens": [vocab]})
    assert valid("/v1/completions", {"prompt": [[1, 2], [3]]})
    for empty in ("", [], [[]], [[1], []], [""], [-1], [vocab]):
        assert not valid("/v1/completions", {"prompt": empty}), empty
    assert valid("/v1/completions", {"prompt": "Hi", "stop_token_ids": [vocab - 1]})
    assert not valid("/v1/completions", {"prompt": "Hi", "stop_token_ids": [vocab]})
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert valid("/v1/chat/completions", {**chat, "tool_choice": "none"})
    assert not valid("/v1/chat/completions", {**chat, "tool_choice": "required"})
    assert not valid("/v1/chat/completions", {**chat, "tool_choice": "auto", "tools": []})
    assert valid("/v1/chat/completions", {**chat, "tool_choice": "required", "tools": [tool]})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"watermark": True}})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"temperature": 0}})
    assert valid("/generate", {"inputs": "Hi", "parameters": {"watermark": False, "temperature": 0.5}})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"stop": [""]}})
    details = {"inputs": "Hi", "parameters": {"decoder_input_details": True}}
    assert valid("/generate", details) and not valid("/generate_stream", details)
    assert not valid("/generate", {**details, "stream": True})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"best_of": 2}})
    assert valid("/generate", {"inputs": "Hi", "parameters": {"best_of": 2, "top_k": 5}})
    limits = state.config
    too_many = {"best_of": limits.max_best_of + 1, "top_k": 5}
    assert not valid("/generate", {"inputs": "Hi", "parameters": too_many})
    assert valid("/generate", {"inputs": "Hi", "parameters": {"truncate": limits.input_limit}})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"truncate": limits.input_limit + 1}})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"best_of": 2, "temperature": 1.0}})
    assert not valid("/v1/completions", {"prompt": "Hi", "stop": ""})
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert not valid("/v1/chat/completions", {"messages": [image]})
    text = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    assert valid("/v1/chat/completions", {"messages": [text]})
    top = limits.max_top_n_tokens
    assert valid("/generate", {"inputs": "Hi", "parameters": {"top_n_tokens": top}})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"top_n_tokens": top + 1}})
    assert not valid("/v1/completions", {"prompt": "Hi", "logprobs": top + 1})
    assert valid("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": top})
    assert not valid("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": top + 1})
    for schema, servable in (({"type": "object"}, True), (True, True), (False, False)):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        assert valid("/v1/chat/completions", {**chat, "response_format": fmt}) == servable, schema
        grammar = {"type": "json", "value": schema}
        assert valid("/generate", {"inputs": "Hi", "parameters": {"grammar": grammar}}) == servable, schema
    most = limits.total_limit - 1  # new tokens after a one-token prompt
    assert valid("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": most}})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": most + 1}})
    assert not valid("/v1/completions", {"prompt": "Hi", "max_tokens": most + 1})
    assert not valid("/v1/chat/completions", {**chat, "max_completion_tokens": most + 1})
    assert valid("/v1/completions", {"prompt": "Hi", "logit_bias": {"0": -100, str(vocab - 1): 100}})
    for key in (str(vocab), "05", "-1", "x", " 1"):
        assert not valid("/v1/completions", {"prompt": "Hi", "logit_bias": {key: 1}}), key
    assert not valid("/v1/completions", {"prompt": "Hi", "logit_bias": {"1": 101}})
    assert not valid("/v1/completions", {"prompt": "Hi", "n": limits.max_n + 1})
    assert not valid("/v1/completions", {"prompt": "Hi", "best_of": limits.max_best_of + 1})
    stops = ["s"] * limits.max_stop_sequences
    assert valid("/v1/completions", {"prompt": "Hi", "stop": stops})
    assert not valid("/v1/completions", {"prompt": "Hi", "stop": [*stops, "t"]})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"stop": [*stops, "t"]}})
    batch = ["Hi"] * limits.max_client_batch_size
    assert valid("/v1/completions", {"prompt": batch}) and not valid(
        "/v1/completions", {"prompt": [*batch, "x"]}
    )
    assert valid(
        "/v1/completions", {"prompt": list(range(1, limits.max_client_batch_size + 3))}
    )  # one prompt
    assert valid("/v1/completions", {"prompt": "Hi", "suffix": ""})
    assert not valid("/v1/completions", {"prompt": "Hi", "suffix": "x"})  # insertion is not served
    assert not valid("/v1/chat/completions", {**chat, "top_logprobs": 2})
    assert valid("/v1/chat/completions", {**chat, "top_logprobs": 0})
    assert not valid("/v1/completions", {"prompt": "Hi", "seed": 2**64})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"seed": 2**64}})
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"top_k": 2**32}})
    assert not valid("/v1/completions", {"prompt": "Hi", "top_k": 2**32})
    grammar = {"type": "json_object", "value": "not a schema"}
    assert not valid("/generate", {"inputs": "Hi", "parameters": {"grammar": grammar}})
    for path in ("/tokenize", "/invocations"):
        assert not valid(path, {}), path
    assert valid("/tokenize", {"inputs": "Hi"}) and valid("/tokenize", {"prompt": "Hi"})
    assert valid("/invocations", chat) and valid("/invocations", {"inputs": "Hi"})
