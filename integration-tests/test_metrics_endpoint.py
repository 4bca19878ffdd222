"""/metrics parses with Prometheus' own text parser and carries every promised name."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

EXPECTED = {
    "tgi_request_count",
    "tgi_request_success",
    "tgi_request_failure",
    "tgi_request_duration",
    "tgi_request_queue_duration",
    "tgi_request_validation_duration",
    "tgi_request_inference_duration",
    "tgi_request_mean_time_per_token_duration",
    "tgi_request_generated_tokens",
    "tgi_request_input_length",
    "tgi_request_max_new_tokens",
    "tgi_batch_current_size",
    "tgi_batch_current_max_tokens",
    "tgi_queue_size",
    "tgserve_time_to_first_token_seconds",
    "tgserve_request_prefill_seconds",
    "tgi_batch_inference_duration",
    "tgi_batch_inference_count",
    "tgserve_inter_token_latency_seconds",
    "tgserve_kv_cache_usage_ratio",
    "tgserve_preemptions",
    "tgserve_guided_deferred_steps",
    "tgserve_prefix_cache_hit_rate",
    "tgserve_prefix_cache_hits",
}


def test_metrics_parse_and_carry_every_name(tiny_server):
    for _ in range(2):  # the second identical prompt can hit the prefix cache
        response = httpx.post(
            f"{tiny_server.url}/generate",
            json={
                "inputs": "The year has twelve months and about 365 days. " * 2,
                "parameters": {"max_new_tokens": 4},
            },
            headers=tiny_server.headers,
            timeout=30,
        )
        assert response.status_code == 200
    headers = {**tiny_server.headers, "content-type": "application/json"}
    httpx.post(f"{tiny_server.url}/generate", content=b"{", headers=headers, timeout=30)
    text = httpx.get(f"{tiny_server.url}/metrics", timeout=10).text  # open without the API key
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert EXPECTED <= set(families)
    success = families["tgi_request_success"].samples[0].value
    assert success >= 2
    failures = {s.labels.get("err") for s in families["tgi_request_failure"].samples}
    assert "validation" in failures
    ttft_count = [
        s for s in families["tgserve_time_to_first_token_seconds"].samples if s.name.endswith("_count")
    ]
    assert ttft_count[0].value >= 2
    assert "tgi_request_success " in text and "tgi_request_success_total" not in text  # TGI's own names


def step_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "tgi_batch_inference_count")
    return {s.labels["method"]: s.value for s in family.samples}


def test_engine_steps_are_timed_by_kind(tiny_server):
    """Each request takes a prompt step, then a decode step a further token. The engine's figures
    reach the router with its next stats (idle: a heartbeat a quarter of a second later)."""
    before = step_counts(tiny_server.url)
    decodes = 0
    for _ in range(2):
        response = httpx.post(
            f"{tiny_server.url}/generate",
            json={"inputs": "Steps of a request. " * 3, "parameters": {"max_new_tokens": 4, "details": True}},
            headers=tiny_server.headers,
            timeout=30,
        )
        assert response.status_code == 200
        decodes += response.json()["details"]["generated_tokens"] - 1  # the first comes from the prompt step
    deadline = time.monotonic() + 5
    while True:
        after = step_counts(tiny_server.url)
        grown = {method: after[method] - before.get(method, 0) for method in after}
        if grown["prefill"] >= 2 and grown["decode"] >= decodes or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert grown["prefill"] >= 2 and grown["decode"] >= decodes, (grown, decodes)


def test_time_to_first_token_splits_into_queue_and_prefill(tiny_server):
    """The engine process reports when it first scheduled each request: the router's queue time
    ends there and the prefill starts, and the two add up to the time to the first token."""
    response = httpx.post(
        f"{tiny_server.url}/generate",
        json={"inputs": "Twelve months make a year. " * 4, "parameters": {"max_new_tokens": 2}},
        headers=tiny_server.headers,
        timeout=30,
    )
    assert response.status_code == 200
    text = httpx.get(f"{tiny_server.url}/metrics", timeout=10).text
    sums = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith("_sum")
    }
    queue = sums["tgi_request_queue_duration_sum"]
    prefill = sums["tgserve_request_prefill_seconds_sum"]
    assert prefill > 0, "no schedule time crossed from the engine: the prefill would count as queue"
    assert queue + prefill == pytest.approx(sums["tgserve_time_to_first_token_seconds_sum"], rel=1e-6)
