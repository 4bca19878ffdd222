"""`tgserve bench`: build the workload once, run it at every concurrency cap, write JSON and a plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

from tgserve.router.bench.http_load import run_load, tokenize_remote
from tgserve.router.bench.offline import load_engine, run_offline
from tgserve.router.bench.plot import plot_runs
from tgserve.router.bench.report import format_summary, summarize
from tgserve.router.bench.workload import build_prompts


def environment() -> dict[str, Any]:
    import os

    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}


def run(args: argparse.Namespace) -> int:
    """Server runs (and offline runs with --offline) at every --max-concurrency value."""
    if args.seed is None:
        args.seed = random.randrange(2**31)  # recorded in the result's config
    tokenize = tokenize_remote(args.url, args.api_key)
    engine = None
    if args.offline:
        engine = load_engine(args.model_id)
        run_offline(
            engine, build_prompts(tokenize, 2, 16, -1), 4, 2
        )  # warm up, as the server's first requests did
    runs: list[dict[str, Any]] = []
    # Server and offline runs alternate per concurrency level, so a change in machine load between
    # them (a shared CI box) skews the comparison as little as possible.
    for level, concurrency in enumerate(args.max_concurrency):
        # Fresh prompts per level: the prefix cache must not serve one level's prompts to the next.
        prompts = build_prompts(tokenize, args.num_prompts, args.input_len, args.seed + level)
        timings, duration = asyncio.run(
            run_load(
                args.url, args.api_key, prompts, args.output_len, concurrency, args.request_rate, args.seed
            )
        )
        runs.append(record("server", concurrency, summarize(timings, duration)))
        if engine is not None:
            timings, duration = run_offline(engine, prompts, args.output_len, concurrency)
            runs.append(record("offline", concurrency, summarize(timings, duration)))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {k: v for k, v in vars(args).items() if k not in ("handler", "api_key")},
        "environment": environment(),
        "runs": runs,
    }
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    title = f"{args.model_id or 'default model'}: {args.input_len} in / {args.output_len} out tokens"
    if plot_runs(runs, args.plot, title):
        print(f"wrote {args.result_json} and {args.plot}")
    else:
        print(f"wrote {args.result_json} (no plot: matplotlib is not installed)")
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1


def record(mode: str, concurrency: int, summary: dict[str, Any]) -> dict[str, Any]:
    print(format_summary(mode, concurrency, summary), flush=True)
    return {"mode": mode, "max_concurrency": concurrency, "summary": summary}
