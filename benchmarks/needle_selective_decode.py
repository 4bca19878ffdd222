"""Needle in a haystack with SmolLM2-135M-Instruct (issue 34, selection accuracy with a real model):
a fact planted at evenly spread depths of a ~7K-token haystack and asked for at the end, answered
greedily once with dense decode attention and once with selective decode attention (a budget of
1,024 tokens by default) over the same prefilled cache (`tgserve.server.testing.needle`).

The acceptance: selection finds the needle at least as often as dense attention, over >= 50
placements. JSON per placement, then a Markdown summary; with --out, both are written there.

    python benchmarks/needle_selective_decode.py --out docs/benchmarks            # the shipped GGUF, CPU
    python benchmarks/needle_selective_decode.py --model DIR --device cuda         # a converted checkpoint
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.testing.needle import needle_run, placements


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """Selection past --min-context tokens, prefix caching (each question's prompt is prefilled
    once), no CUDA graphs (the long-context graphs are captured selecting)."""
    return LLMEngine(
        EngineArgs(
            model=args.model or str(default_model_gguf()),
            device=args.device,
            dtype=args.dtype,
            decode_attention_budget=args.budget,
            decode_attention_min_context=args.min_context,
            enable_prefix_caching=True,
            cuda_graphs=False,
            max_num_batched_tokens=args.chunk,
        )
    )


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a model directory or .gguf (default: the shipped SmolLM2 GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--placements", type=int, default=50)
    parser.add_argument("--haystack-tokens", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--min-context", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--out", type=Path, help="a folder for the JSON and Markdown records")
    args = parser.parse_args()

    start = time.perf_counter()
    engine = build_engine(args)
    rows = []
    for placement in placements(args.placements):
        result = needle_run(engine, placement, args.haystack_tokens)
        rows.append({"depth": round(placement.depth, 4), "number": placement.number,
                     "prompt_tokens": result.prompt_tokens, "dense": result.dense, "selective": result.selective,
                     "dense_found": result.dense_found, "selective_found": result.selective_found})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    dense = sum(r["dense_found"] for r in rows)
    selective = sum(r["selective_found"] for r in rows)
    both = sum(r["dense_found"] and r["selective_found"] for r in rows)
    lengths = [r["prompt_tokens"] for r in rows]
    summary = (
        f"# Needle in a haystack, dense against selective decode attention\n\n"
        f"{datetime.date.today()}, commit {commit()}, device {args.device}, {args.dtype}, model "
        f"{args.model or 'SmolLM2-135M-Instruct (shipped GGUF)'}; `{' '.join(sys.argv)}`: budget {args.budget}, selection past {args.min_context} tokens, {time.perf_counter() - start:.0f} s.\n\n"
        f"| placements | prompt tokens | dense found | selective found | found by both | dense only | selective only |\n"
        f"|---|---|---|---|---|---|---|\n"
        f"| {len(rows)} | {min(lengths):,}-{max(lengths):,} | {dense} | {selective} | {both} | {dense - both} | "
        f"{selective - both} |\n"
    )  # fmt: skip
    print(summary)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{datetime.date.today()}-needle-selective-decode-{args.device}"
        (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(summary)


if __name__ == "__main__":
    main()
