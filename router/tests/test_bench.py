"""`tgserve bench`'s pure parts: the workload and the summary."""

from __future__ import annotations

import argparse
import random

import pytest

from tgserve.router.bench.cli import concurrency_list
from tgserve.router.bench.report import RequestTiming, summarize
from tgserve.router.bench.workload import arrival_delays, build_prompts


def test_prompts_have_the_exact_length_and_differ(tokenizer):
    prompts = build_prompts(lambda text: tokenizer.encode(text, add_special_tokens=False), 4, 50, seed=1)
    assert all(len(p) == 50 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 4  # no shared first block: no prefix-cache flattery
    again = build_prompts(lambda text: tokenizer.encode(text, add_special_tokens=False), 4, 50, seed=1)
    assert again == prompts


def test_arrivals():
    assert arrival_delays(random.Random(0), 3, float("inf")) == [0.0, 0.0, 0.0]
    delays = arrival_delays(random.Random(0), 2000, 10.0)
    assert 0.08 < sum(delays) / len(delays) < 0.12


def test_summary_latencies_and_throughput():
    ok = RequestTiming(
        prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, token_times=[0.1, 0.2, 0.3, 0.4, 0.5]
    )
    failed = RequestTiming(prompt_len=10, error="HTTP 500")
    summary = summarize([ok, failed], duration_s=2.0)
    assert (summary["completed"], summary["failed"]) == (1, 1)
    assert summary["ttft_ms"]["median"] == pytest.approx(100.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert summary["itl_ms"]["p99"] == pytest.approx(100.0)
    assert summary["output_throughput"] == pytest.approx(2.5)


def test_concurrency_flag():
    assert concurrency_list("1,8,32") == [1, 8, 32]
    with pytest.raises(argparse.ArgumentTypeError):
        concurrency_list("0,x")
