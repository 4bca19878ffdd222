"""CPU benchmark: SmolLM2-135M-Instruct through the engine and through transformers `generate`, one run.

Workloads (issue 2):
- uniform: 1, 8 and 32 requests of 128-token prompts and 128 new tokens. Output tokens/s for the
  engine, for `generate` one request at a time, and for `generate` on the whole set as one batch.
- mixed: 64 requests, prompts of 16-1024 tokens and 8-256 new tokens drawn with a fixed seed; total
  time for the engine and for `generate` on left-padded batches of 32 in arrival order.
Greedy, EOS ignored, float32. Writes a Markdown report under --out.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import subprocess
import time
from pathlib import Path

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.protocol.params import SamplingParams


def random_prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def engine_run(engine: LLMEngine, prompts: list[list[int]], new_tokens: list[int]) -> tuple[float, int]:
    """Submit everything at once, step until done; (seconds, output tokens)."""
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):
        engine.add_request(
            f"b{start}-{i}", prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        )
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, produced


def generate_batch(model: torch.nn.Module, prompts: list[list[int]], max_new: int, pad_id: int) -> float:
    """One left-padded `generate` call; seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    return time.perf_counter() - start


def uniform(engine: LLMEngine, model: torch.nn.Module, rng: random.Random, pad: int) -> list[str]:
    rows = [
        "| requests | engine tok/s | generate one-at-a-time tok/s | generate one batch tok/s |",
        "|---|---|---|---|",
    ]
    sequential_tps = None
    for count in (1, 8, 32):
        prompts = random_prompts(rng, [128] * count, engine.vocab_size)
        seconds, produced = engine_run(engine, prompts, [128] * count)
        if sequential_tps is None:  # one request at a time: the same rate whatever the count
            sequential_tps = 128 / generate_batch(model, prompts[:1], 128, pad)
        batch_tps = 128 * count / generate_batch(model, prompts, 128, pad)
        rows.append(f"| {count} | {produced / seconds:.1f} | {sequential_tps:.1f} | {batch_tps:.1f} |")
        print(rows[-1], flush=True)
    return rows


def mixed(engine: LLMEngine, model: torch.nn.Module, rng: random.Random, pad: int) -> list[str]:
    lengths = [rng.randint(16, 1024) for _ in range(64)]
    new_tokens = [rng.randint(8, 256) for _ in range(64)]
    prompts = random_prompts(rng, lengths, engine.vocab_size)
    engine_seconds, produced = engine_run(engine, prompts, new_tokens)
    hf_seconds = 0.0
    for start in range(0, 64, 32):  # padded batches of 32 in arrival order, each runs to its longest
        hf_seconds += generate_batch(
            model, prompts[start : start + 32], max(new_tokens[start : start + 32]), pad
        )
    rows = [
        f"- requests: 64, prompt tokens {sum(lengths)}, output tokens {sum(new_tokens)} (engine produced {produced})",
        f"- engine: {engine_seconds:.1f} s",
        f"- generate, padded batches of 32: {hf_seconds:.1f} s",
        f"- speed-up: {hf_seconds / engine_seconds:.2f}x (target >= 2x)",
    ]
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--skip-uniform", action="store_true")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    gguf = default_model_gguf()
    engine = LLMEngine(EngineArgs(model=str(gguf), max_num_batched_tokens=2048, max_num_seqs=64))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    pad = engine.tokenizer.pad_token_id or 0
    rng = random.Random(0)
    report = [
        "# Engine vs transformers generate on CPU (SmolLM2-135M-Instruct, float32, greedy)",
        "",
        f"- date: {datetime.date.today()}",
        f"- commit: {_commit()}",
        f"- device: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        f"- torch {torch.__version__}",
        "",
    ]
    if not args.skip_uniform:
        report += ["## Uniform: 128-token prompts, 128 new tokens", "", *uniform(engine, model, rng, pad)]
    if not args.skip_mixed:
        report += [
            "",
            "## Mixed: 64 requests, prompts 16-1024, 8-256 new tokens (seed 0)",
            "",
            *mixed(engine, model, random.Random(0), pad),  # its own seed: the same workload when run alone
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-mixed" if args.skip_uniform else ""
    path = args.out / f"{datetime.date.today()}-engine-cpu{suffix}.md"
    path.write_text("\n".join(report) + "\n")
    print(f"wrote {path}")


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
