"""Prometheus metrics: TGI's names, plus what TGI lacks (TTFT, ITL, KV usage, preemptions, prefix cache).

Request metrics are recorded by the router as requests run. Engine metrics are read at scrape time
from the last `EngineStats` the engine pushed, through a custom collector, so they cost nothing
between scrapes. Each app gets its own registry (tests build several apps in one process).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tgserve.server.protocol.outputs import STEP_BUCKETS, EngineStats, StepDurations

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384

# TGI's counters carry no `_total` (its Rust exporter adds none), and dashboards and alerts written
# for TGI query them so: `rate(tgi_request_success[5m])`. prometheus_client appends `_total` to every
# counter, so the rendered text takes it off these; tgserve's own counters keep the convention.
TGI_COUNTERS = (
    "tgi_request_count",
    "tgi_request_success",
    "tgi_request_failure",
    "tgi_batch_inference_count",
)
TGI_COUNTER_SUFFIX = re.compile(rf"\b({'|'.join(TGI_COUNTERS)})_total\b")

StatsSource = Callable[[], tuple[EngineStats | None, int]]  # (latest stats, block size)


class EngineStatsCollector(Collector):
    """Engine gauges and counters from the latest `EngineStats` (zeros until the engine reports)."""

    def __init__(self, source: StatsSource):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        stats, block_size = self.source()
        stats = stats or EngineStats(0, 0, 0, 0, 0, 0, 0)
        used_blocks = stats.num_total_blocks - stats.num_free_blocks
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        yield _gauge("tgi_batch_current_size", "Requests running in the engine", stats.num_running)
        yield _gauge("tgi_queue_size", "Requests waiting in the engine's queue", stats.num_waiting)
        yield _gauge(
            "tgi_batch_current_max_tokens",
            "Tokens the running batch holds in the KV cache",
            used_blocks * block_size,
        )
        yield _gauge(
            "tgserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", stats.kv_cache_usage
        )
        yield _gauge("tgserve_kv_cache_free_blocks", "Free KV cache blocks", stats.num_free_blocks)
        yield _gauge("tgserve_kv_cache_total_blocks", "KV cache blocks in the pool", stats.num_total_blocks)
        yield _gauge(
            "tgserve_engine_step_tokens", "Tokens computed in the engine's last step", stats.step_num_tokens
        )
        yield _gauge("tgserve_engine_step_seqs", "Requests in the engine's last step", stats.step_num_seqs)
        yield _counter(
            "tgserve_preemptions", "Requests preempted for lack of KV blocks", stats.num_preemptions
        )
        yield _counter(
            "tgserve_guided_deferred_steps",
            "Steps that gave a guided request no token: its grammar's mask was late",
            stats.num_deferred_steps,
        )
        yield _counter(
            "tgserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            stats.prefix_cache_queries,
        )
        yield _counter(
            "tgserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits
        )
        yield _gauge("tgserve_prefix_cache_hit_rate", "Prefix-cache hits / queries since start", hit_rate)
        yield from _host_tier_metrics(stats)
        yield from _step_metrics(stats.step_durations)


def _host_tier_metrics(stats: EngineStats) -> Iterator[Metric]:
    """The host tier of the prefix cache (--kv-offload-gb): zeros when it is off."""
    yield _gauge(
        "tgserve_kv_host_total_blocks", "KV blocks the host tier holds at most", stats.host_num_total_blocks
    )
    yield _gauge("tgserve_kv_host_used_blocks", "KV blocks the host tier holds", stats.host_num_used_blocks)
    yield _counter(
        "tgserve_kv_host_prefix_hits", "Prompt tokens loaded from the host tier instead of computed",
        stats.host_prefix_hits,
    )  # fmt: skip
    bytes_per_block = stats.host_block_bytes
    moved = (
        ("offloaded", "written from the KV pool to the host tier", stats.host_offloaded_blocks),
        ("loaded", "loaded from the host tier into the KV pool", stats.host_loaded_blocks),
    )
    for name, what, blocks in moved:
        yield _counter(f"tgserve_kv_host_{name}_blocks", f"KV blocks {what}", blocks)
        yield _counter(
            f"tgserve_kv_host_{name}_bytes", f"Bytes of KV blocks {what}", blocks * bytes_per_block
        )
    yield _counter(
        "tgserve_kv_host_evicted_blocks",
        "KV blocks dropped from the full host tier",
        stats.host_evicted_blocks,
    )
    yield _counter(
        "tgserve_kv_host_swapped_out_requests",
        "Preempted requests whose KV went to the host tier instead of being recomputed",
        stats.host_swapped_out_requests,
    )
    yield _counter(
        "tgserve_kv_host_spilled_blocks",
        "KV blocks of running requests whose context outgrew the KV pool, moved to the host tier and read there",
        stats.host_spilled_blocks,
    )
    chosen = "Host-tier blocks chosen by selective decode (per layer and KV head)"
    yield _counter(
        "tgserve_kv_host_hot_block_hits",
        f"{chosen} read from the hot-block cache in device memory",
        stats.host_hot_block_hits,
    )
    yield _counter(
        "tgserve_kv_host_hot_block_misses", f"{chosen} read over the link", stats.host_hot_block_misses
    )


def _step_metrics(durations: list[StepDurations]) -> Iterator[Metric]:
    """TGI's batch metrics, by method (prefill, decode), from the engine's own step timings."""
    histogram = HistogramMetricFamily(
        "tgi_batch_inference_duration", "Duration of one engine step (s)", labels=["method"]
    )
    count = CounterMetricFamily("tgi_batch_inference_count", "Engine steps", labels=["method"])
    for steps in durations:
        cumulative, buckets = 0, []
        for bound, n in zip((*STEP_BUCKETS, float("inf")), steps.bucket_counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        histogram.add_metric([steps.method], buckets, sum_value=steps.sum_s)
        count.add_metric([steps.method], steps.count)
    yield histogram
    yield count


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class RouterMetrics:
    """Every metric the router exposes, in one registry."""

    def __init__(self, stats_source: StatsSource):
        # No `_created` series: TGI has none, and they add a line to every counter and histogram.
        # (A process-wide switch of prometheus_client; the router process has only these metrics.)
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_count = Counter("tgi_request_count", "Generation requests received", registry=r)
        self.request_success = Counter(
            "tgi_request_success", "Generation requests that succeeded", registry=r
        )
        self.request_failure = Counter(
            "tgi_request_failure", "Generation requests that failed, by error kind", ["err"], registry=r
        )
        self.request_duration = _histogram("tgi_request_duration", "End-to-end request latency (s)", r)
        self.queue_duration = _histogram(
            "tgi_request_queue_duration",
            "Time from submission to the engine until it first schedules the request (s)",
            r,
        )
        self.validation_duration = _histogram(
            "tgi_request_validation_duration",
            "Time to validate and tokenize a request (s)",
            r,
            LATENCY_BUCKETS,
        )
        self.inference_duration = _histogram(
            "tgi_request_inference_duration",
            "Time from the request's first step (its prefill) to its last token (s)",
            r,
        )
        self.mean_time_per_token = _histogram(
            "tgi_request_mean_time_per_token_duration",
            "Inference time over the generated tokens (s)",
            r,
            LATENCY_BUCKETS,
        )
        self.generated_tokens = _histogram(
            "tgi_request_generated_tokens", "Generated tokens per request", r, TOKEN_BUCKETS
        )
        self.max_new_tokens = _histogram(
            "tgi_request_max_new_tokens", "Most new tokens a request may generate", r, TOKEN_BUCKETS
        )
        self.input_length = _histogram(
            "tgi_request_input_length", "Prompt tokens per request", r, TOKEN_BUCKETS
        )
        self.time_to_first_token = _histogram(
            "tgserve_time_to_first_token_seconds", "Time to first token (s)", r, DURATION_BUCKETS
        )
        self.prefill = _histogram(
            "tgserve_request_prefill_seconds",
            "Time from a sequence's first step to its first token: the prompt's prefill (s)",
            r,
            DURATION_BUCKETS,
        )
        self.inter_token_latency = _histogram(
            "tgserve_inter_token_latency_seconds",
            "Time between two tokens of a sequence (s)",
            r,
            LATENCY_BUCKETS,
        )
        self.in_flight = Gauge(
            "tgserve_requests_in_flight", "HTTP generation requests being served", registry=r
        )
        r.register(EngineStatsCollector(stats_source))

    def render(self) -> bytes:
        """The text exposition format, with TGI's counters under TGI's own names."""
        return TGI_COUNTER_SUFFIX.sub(r"\1", generate_latest(self.registry).decode()).encode()


def _histogram(
    name: str, documentation: str, registry: CollectorRegistry, buckets: tuple[float, ...] = DURATION_BUCKETS
) -> Histogram:
    return Histogram(name, documentation, registry=registry, buckets=buckets)
