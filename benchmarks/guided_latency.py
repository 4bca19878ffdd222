"""Guided decoding's cost (issue 37): the decode step of 64 concurrent schema-guided requests beside
64 unguided ones, and how long a schema takes to compile.

    python benchmarks/guided_latency.py [--model DIR_OR_GGUF] [--out docs/benchmarks]

SmolLM2-135M-Instruct by default (its GGUF, float32 on CPU; the serving dtype on CUDA). Both runs
submit the same 64 chat prompts at once, sampled (temperature 1, a seed each); the guided run holds
each reply to a JSON schema. Inter-token latency is the median wall time of the steps during which
all 64 requests are decoding (a guided request ends when its grammar completes, so steps after the
first one ends are not counted, in either run). Compile: the router's check of a schema (llguidance,
without a tokenizer) and a request's matcher (with the model's tokenizer), p50 and p90 over repeats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.protocol.grammar import check_grammar
from tgserve.server.protocol.params import GuidedDecoding, SamplingParams

REQUESTS = 64
NEW_TOKENS = 96
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"enum": ["France", "Germany", "Italy", "Spain"]},
        "population_millions": {"type": "number", "minimum": 0},
        "landmarks": {
            "type": "array",
            "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                        "year": {"type": "integer"}},
                      "required": ["name", "year"], "additionalProperties": False},
            "minItems": 3,
            "maxItems": 6,
        },
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}  # fmt: skip
CITIES = ["Paris", "Berlin", "Rome", "Madrid", "Lyon", "Munich", "Milan", "Seville"]


def prompts(engine: LLMEngine) -> list[list[int]]:
    out = []
    for i in range(REQUESTS):
        question = f"Describe {CITIES[i % len(CITIES)]} as JSON: its country, population and landmarks ({i})."
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        out.append(engine.tokenizer.encode(text, add_special_tokens=False))
    return out


def run(engine: LLMEngine, prompt_ids: list[list[int]], guided: GuidedDecoding | None, tag: str) -> dict:
    for i, ids in enumerate(prompt_ids):
        params = SamplingParams(temperature=1.0, seed=i, max_new_tokens=NEW_TOKENS, guided=guided,
                                ignore_eos=guided is None)  # fmt: skip
        engine.add_request(f"{tag}-{i}", ids, params)
    steps, tokens, finished = [], 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        outputs = engine.step()
        spent = time.perf_counter() - before
        decoding = [o for o in outputs if o.new_token_ids]
        tokens += sum(len(o.new_token_ids) for o in outputs)
        if len(decoding) == len(prompt_ids) and finished == 0:
            steps.append(spent)
        finished += sum(o.finished for o in outputs)
    total = time.perf_counter() - start
    steps = steps[1:] or [float("nan")]  # the first such step may carry the prompts' last prefill
    return {"steps": len(steps), "itl_ms": 1e3 * statistics.median(steps), "mean_ms": 1e3 * statistics.fmean(steps),
            "tokens": tokens, "total_s": total}  # fmt: skip


def compile_times(engine: LLMEngine, repeats: int) -> dict:
    spec = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    check = []
    for _ in range(repeats):
        start = time.perf_counter()
        check_grammar(spec)
        check.append(time.perf_counter() - start)
    guided = engine.runner.guided if hasattr(engine, "runner") else None
    backend = guided._grammar_backend() if guided is not None else None  # noqa: SLF001 - built once, as served
    matcher = []
    for i in range(repeats if backend is not None else 0):
        # A schema of its own each time: xgrammar caches compiled grammars by their schema's text.
        fresh = GuidedDecoding("json_schema", json.dumps({**SCHEMA, "title": f"answer {i}"}))
        start = time.perf_counter()
        backend.matcher(fresh)  # the grammar compiled against the tokenizer
        matcher.append(time.perf_counter() - start)

    def pct(xs: list[float], q: float) -> float:
        return 1e3 * sorted(xs)[int(q * (len(xs) - 1))] if xs else float("nan")

    return {"check_p50_ms": pct(check, 0.5), "check_p90_ms": pct(check, 0.9), "matcher_p50_ms": pct(matcher, 0.5),
            "matcher_p90_ms": pct(matcher, 0.9)}  # fmt: skip


def mask_stage_ms(engine: LLMEngine, spec: GuidedDecoding, repeats: int) -> float:
    """Median ms of one step's mask work for REQUESTS guided rows, each matcher at its grammar's start."""
    from tgserve.server.sampling.guided import apply_token_mask

    guided = engine.runner.guided
    ids = [f"mask-{i}" for i in range(REQUESTS)]
    for request_id in ids:
        guided.add(request_id, spec)
    logits = torch.randn(REQUESTS, engine.vocab_size)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply_token_mask(logits, guided.mask(ids, logits))
        times.append(time.perf_counter() - start)
    for request_id in ids:
        guided.remove(request_id)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a model directory or GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=None, help="write a Markdown report here")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--guided-decoding-backend", default="llguidance", help="llguidance or xgrammar")
    parser.add_argument("--skip-runs", action="store_true", help="only the mask stage and compile times")
    parser.add_argument(
        "--load-format", default="auto",
        help="dummy: random weights (a model directory's config and tokenizer: a large model's shape "
        "with a real vocabulary, where its weights cannot be had)",
    )  # fmt: skip
    args = parser.parse_args()
    model = args.model or str(default_model_gguf())
    engine = LLMEngine(EngineArgs(model=model, max_num_seqs=REQUESTS, max_num_batched_tokens=4096,
                                  guided_decoding_backend=args.guided_decoding_backend,
                                  load_format=args.load_format))  # fmt: skip
    prompt_ids = prompts(engine)
    spec = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    run(engine, prompt_ids[:4], spec, "warm")  # the matcher tokenizer, kernels, allocator
    # Alternated, so that a drift of the machine's speed reaches both kinds of run alike.
    names = [] if args.skip_runs else ["unguided", "schema-guided"] * 2 + ["unguided"]
    rows = [(name, run(engine, prompt_ids, spec if name == "schema-guided" else None, f"r{i}"))
            for i, name in enumerate(names)]  # fmt: skip
    compiled = compile_times(engine, args.repeats)
    mask_ms = mask_stage_ms(engine, spec, args.repeats)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    lines = [
        f"- date: {datetime.date.today()}, commit {_commit()}, device: {device}, {torch.get_num_threads()} threads",
        f"- model: {model} ({args.load_format} weights); {REQUESTS} concurrent requests, up to {NEW_TOKENS} new tokens, temperature 1; "
        f"grammars by {args.guided_decoding_backend}",
        "",
        "| run | steps with all 64 decoding | ITL median ms | ITL mean ms | output tokens | total s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['steps']} | {r['itl_ms']:.2f} | {r['mean_ms']:.2f} | {r['tokens']} | "
                     f"{r['total_s']:.2f} |")  # fmt: skip
    if rows:
        unguided = statistics.median(r["itl_ms"] for name, r in rows if name == "unguided")
        guided = statistics.median(r["itl_ms"] for name, r in rows if name == "schema-guided")
        lines += ["", f"Guided ITL (median of the guided runs) against unguided (median of theirs): "
                  f"{guided / unguided - 1:+.1%}."]  # fmt: skip
    lines += [
        "",
        f"The mask stage alone, {REQUESTS} guided rows (the library's masks, their copy and the logits masked): "
        f"{mask_ms:.2f} ms a step.",
        f"Schema compile (router check, no tokenizer): p50 {compiled['check_p50_ms']:.2f} ms, p90 "
        f"{compiled['check_p90_ms']:.2f}; a request's matcher (with the tokenizer): p50 "
        f"{compiled['matcher_p50_ms']:.2f} ms, p90 {compiled['matcher_p90_ms']:.2f}.",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        (args.out / f"{datetime.date.today()}-guided-latency-{kind}.md").write_text(report)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
