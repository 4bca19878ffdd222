"""`tgserve bench` flags. Registering the command imports nothing heavy; `run` does the work."""

from __future__ import annotations

import argparse
from typing import Any


def concurrency_list(text: str) -> list[int]:
    """ "1,8,32" -> [1, 8, 32]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("concurrency values must be positive")
    return values


def add_bench_command(subparsers: Any) -> None:
    """Register `tgserve bench` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="Benchmark a running server (TTFT, TPOT, ITL, latency, throughput)",
        description="Send random prompts of a fixed length to a running server's /v1/completions (streaming) "
        "and report latency percentiles and throughput like `vllm bench serve`. With --offline, the same "
        "workload also runs through the offline engine in this process, which shows the router's overhead.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="Server base URL")
    parser.add_argument("--api-key", default=None, help="Bearer token, if the server requires one")
    parser.add_argument(
        "--model-id", default=None, help="Model for --offline (the server's model); None = default"
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="Requests per concurrency level")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens")
    parser.add_argument(
        "--output-len", type=int, default=64, help="Generated tokens per request (EOS ignored)"
    )
    parser.add_argument(
        "--max-concurrency",
        type=concurrency_list,
        default=[1, 8, 32],
        help="Concurrency caps to run, e.g. 1,8,32",
    )
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second"
    )
    parser.add_argument(
        "--offline", action="store_true", help="Also run the workload through the offline engine"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="Seed of the random prompts and arrivals (default: a fresh one, so that the server's prefix cache "
        "holds none of the prompts from an earlier run)",
    )
    parser.add_argument("--result-json", default="bench.json", help="Where to write the results")
    parser.add_argument("--plot", default="bench.png", help="Where to write the plot (needs matplotlib)")
    parser.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from tgserve.router.bench.runner import run

    return run(args)
