"""Per-request timings and their summary: the numbers `vllm bench serve` reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestTiming:
    """One request, in seconds from its own start; token_times are when output arrived."""

    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None and self.ttft is not None


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / median / p90 / p99, in milliseconds by default."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    array = np.asarray(values) * scale
    return {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
    }


def summarize(timings: list[RequestTiming], duration_s: float) -> dict[str, Any]:
    """TTFT, TPOT, ITL and end-to-end latency percentiles (ms), and throughputs."""
    done = [t for t in timings if t.ok]
    tpots = [
        (t.latency - t.ttft) / (t.output_tokens - 1)  # type: ignore[operator]
        for t in done
        if t.output_tokens > 1
    ]
    itls = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    output_tokens = sum(t.output_tokens for t in done)
    input_tokens = sum(t.prompt_len for t in done)
    return {
        "completed": len(done),
        "failed": len(timings) - len(done),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s else 0.0,
        "ttft_ms": percentiles([t.ttft for t in done]),  # type: ignore[misc]
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles(itls),
        "e2el_ms": percentiles([t.latency for t in done]),  # type: ignore[misc]
    }


def format_summary(mode: str, concurrency: int, summary: dict[str, Any]) -> str:
    """One human-readable block per run, printed as runs finish."""
    lines = [
        f"== {mode}, max concurrency {concurrency} ==",
        f"  completed {summary['completed']}, failed {summary['failed']} in {summary['duration_s']:.2f} s",
        f"  request throughput {summary['request_throughput']:.2f} req/s, "
        f"output {summary['output_throughput']:.1f} tok/s",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[key]
        lines.append(
            f"  {key[:-3].upper():5s} ms: mean {stats['mean']:8.1f}  median {stats['median']:8.1f}  "
            f"p90 {stats['p90']:8.1f}  p99 {stats['p99']:8.1f}"
        )
    return "\n".join(lines)
