"""The /metrics exposition parses and carries every name promised (TGI's and tgserve's own)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tgserve.router.metrics import RouterMetrics
from tgserve.server.outputs import EngineStats

TGI_NAMES = {
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
    "tgi_batch_current_size",
    "tgi_batch_current_max_tokens",
    "tgi_queue_size",
}
OWN_NAMES = {
    "tgserve_time_to_first_token_seconds",
    "tgserve_request_prefill_seconds",
    "tgserve_inter_token_latency_seconds",
    "tgserve_kv_cache_usage_ratio",
    "tgserve_kv_cache_free_blocks",
    "tgserve_kv_cache_total_blocks",
    "tgserve_preemptions",
    "tgserve_prefix_cache_hits",
    "tgserve_prefix_cache_queries",
    "tgserve_prefix_cache_hit_rate",
}


def families(metrics: RouterMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def sample(metrics: RouterMetrics, name: str) -> float:
    family = families(metrics)[name]
    return family.samples[0].value  # type: ignore[attr-defined]


def test_every_name_is_exposed_before_any_request():
    names = set(families(RouterMetrics(lambda: (None, 16))))
    assert TGI_NAMES | OWN_NAMES <= names


def test_engine_stats_are_read_at_scrape_time():
    stats = {"value": EngineStats(3, 2, 30, 100, 4, 200, 50)}
    metrics = RouterMetrics(lambda: (stats["value"], 16))
    assert sample(metrics, "tgi_batch_current_size") == 3
    assert sample(metrics, "tgi_queue_size") == 2
    assert sample(metrics, "tgserve_kv_cache_usage_ratio") == 0.7
    assert sample(metrics, "tgi_batch_current_max_tokens") == 70 * 16
    assert sample(metrics, "tgserve_preemptions") == 4
    assert sample(metrics, "tgserve_prefix_cache_hit_rate") == 0.25
    stats["value"] = EngineStats(0, 0, 100, 100, 4, 200, 50)
    assert sample(metrics, "tgserve_kv_cache_free_blocks") == 100


def test_failures_are_labelled():
    metrics = RouterMetrics(lambda: (None, 16))
    metrics.request_failure.labels(err="validation").inc()
    family = families(metrics)["tgi_request_failure"]
    labels = {s.labels["err"]: s.value for s in family.samples if s.name.endswith("_total")}  # type: ignore
    assert labels == {"validation": 1.0}
