"""The /metrics exposition parses and carries every name promised (TGI's and tgserve's own)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tgserve.router.metrics import RouterMetrics
from tgserve.server.core.step_timing import StepClock
from tgserve.server.protocol.outputs import EngineStats

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
    "tgi_request_max_new_tokens",
    "tgi_batch_current_size",
    "tgi_batch_current_max_tokens",
    "tgi_queue_size",
    "tgi_batch_inference_duration",
    "tgi_batch_inference_count",
}
OWN_NAMES = {
    "tgserve_time_to_first_token_seconds",
    "tgserve_request_prefill_seconds",
    "tgserve_inter_token_latency_seconds",
    "tgserve_kv_cache_usage_ratio",
    "tgserve_kv_cache_free_blocks",
    "tgserve_kv_cache_total_blocks",
    "tgserve_preemptions",
    "tgserve_guided_deferred_steps",
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


def test_the_hot_block_cache_counts_are_exposed():
    stats = EngineStats(1, 0, 30, 100, 0, 0, 0, host_hot_block_hits=850, host_hot_block_misses=150)
    metrics = RouterMetrics(lambda: (stats, 16))
    assert sample(metrics, "tgserve_kv_host_hot_block_hits") == 850
    assert sample(metrics, "tgserve_kv_host_hot_block_misses") == 150


def test_failures_are_labelled():
    metrics = RouterMetrics(lambda: (None, 16))
    metrics.request_failure.labels(err="validation").inc()
    family = families(metrics)["tgi_request_failure"]
    labels = {s.labels["err"]: s.value for s in family.samples if s.name.endswith("_total")}  # type: ignore
    assert labels == {"validation": 1.0}


def test_tgi_counters_are_exposed_under_tgi_names():
    """As TGI's exporter writes them, without `_total`, which queries written for TGI expect; no
    `_created` series; tgserve's own counters keep the `_total` convention."""
    metrics = RouterMetrics(lambda: (None, 16))
    metrics.request_count.inc()
    metrics.request_success.inc()
    metrics.request_failure.labels(err="validation").inc()
    lines = metrics.render().decode().splitlines()
    for line in (
        "# TYPE tgi_request_count counter",
        "tgi_request_count 1.0",
        "tgi_request_success 1.0",
        'tgi_request_failure{err="validation"} 1.0',
        "# TYPE tgi_batch_inference_count counter",
        "tgserve_preemptions_total 0.0",
    ):
        assert line in lines
    assert not [line for line in lines if "tgi_" in line and "_total" in line]
    assert not [line for line in lines if "_created" in line]


def test_step_durations_are_tgi_batch_histograms():
    clock = StepClock()
    for seconds, kind in ((0.3, "prefill"), (0.004, "decode"), (0.006, "decode"), (100.0, "decode")):
        clock.record(seconds, kind)
    stats = EngineStats(0, 0, 10, 10, 0, 0, 0, step_durations=clock.snapshot())
    exposed = families(RouterMetrics(lambda: (stats, 16)))
    family = exposed["tgi_batch_inference_duration"]
    values = {(s.name, s.labels["method"], s.labels.get("le")): s.value for s in family.samples}  # type: ignore
    assert values[("tgi_batch_inference_duration_bucket", "decode", "0.005")] == 1
    assert values[("tgi_batch_inference_duration_bucket", "decode", "0.01")] == 2
    assert values[("tgi_batch_inference_duration_bucket", "decode", "30.0")] == 2
    assert values[("tgi_batch_inference_duration_bucket", "decode", "+Inf")] == 3
    assert values[("tgi_batch_inference_duration_count", "decode", None)] == 3
    assert values[("tgi_batch_inference_duration_sum", "decode", None)] == pytest.approx(100.01)
    assert values[("tgi_batch_inference_duration_bucket", "prefill", "0.25")] == 0
    assert values[("tgi_batch_inference_duration_bucket", "prefill", "0.5")] == 1
    counts = exposed["tgi_batch_inference_count"]
    assert {s.labels["method"]: s.value for s in counts.samples} == {"prefill": 1, "decode": 3}  # type: ignore
