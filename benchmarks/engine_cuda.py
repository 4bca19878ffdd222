"""GPU benchmark (issue 5): the engine on random weights at Llama-3-8B's shape, beside transformers.

No download: the config is written here and the weights are random (`load_format="dummy"` for the
engine, `from_config` for transformers), bf16. Measures, in one run:
  (a) batch-1 decode, 512-token prompt, 256 new tokens: ms per output token;
  (b) 256 requests at once, 512 prompt + 128 new tokens each: total seconds and output tokens/s;
  (c) time to first token of one long prompt, dense and sparse prefill;
  (d) peak GPU memory and the KV pool's size in tokens at --gpu-memory-utilization;
and the baseline, transformers `generate`, in the same run (skippable). Prints a Markdown report and
writes it (and a JSON of the numbers) under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.core.heap import freeze_startup_heap
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)


def write_model_dir(root: Path, num_layers: int) -> Path:
    """config.json at Llama-3-8B's shape (layers adjustable for quick runs) and a small tokenizer."""
    from tgserve.server.testing.tiny_tokenizer import save_fast_tokenizer

    directory = root / "llama3-8b-shape"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": num_layers}))
    save_fast_tokenizer(directory)
    return directory


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (count, length), generator=generator).tolist()


def run_engine(engine: LLMEngine, batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Submit everything, step to the end. Times to the first token of all, and to the end; the
    wall time of the steps that scheduled prompt tokens (and the first step after them, whose
    outputs they are) apart from the decode-only steps after them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(batch):
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        engine.add_request(f"r{start}-{i}", prompt, params)
    first_all, produced, decode_steps, last_prefill, step_times = None, 0, [], 0.0, []
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        produced += sum(len(o.new_token_ids) for o in engine.step())
        step_times.append(time.perf_counter() - step_start)
        stats = engine.stats()
        if (
            stats.step_num_tokens == stats.step_num_seqs == len(batch)
        ):  # every request decoding: the steady state
            decode_steps.append(time.perf_counter() - step_start)
        scheduled = engine.scheduler.stats()
        if scheduled.step_num_tokens > scheduled.step_num_seqs:  # this step has prompt tokens
            last_prefill = time.perf_counter()
        if first_all is None and produced >= len(batch):
            first_all = time.perf_counter() - start
    total = time.perf_counter() - start
    decode_steps.sort()
    median = decode_steps[len(decode_steps) // 2] if decode_steps else float("nan")
    return {
        "total_s": total,
        "prefill_s": first_all or total,
        "prompt_phase_s": last_prefill - start if last_prefill else 0.0,
        "output_tokens": produced,
        "decode_step_s": median,
        # The three slowest steps (seconds, step number): a pause shows here, not in the median.
        "slowest_steps": sorted((t, i) for i, t in enumerate(step_times))[-3:],
    }


@contextlib.contextmanager
def profiled(path: Path, row_limit: int = 25) -> Iterator[None]:
    """Profile the block's GPU and CPU work; write its kernels, by total GPU time, to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=row_limit))


def kernel_profile(engine: LLMEngine, batch: list[list[int]], path: Path) -> None:
    """The GPU kernels of a few steady decode steps, by total time, written to `path`."""
    for i, prompt in enumerate(batch):
        engine.add_request(
            f"prof-{len(batch)}-{i}",
            prompt,
            SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
        )
    engine.step()
    while engine.stats().step_num_tokens != len(batch):  # until every request is decoding
        engine.step()
    with profiled(path, row_limit=45):
        for _ in range(5):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def prefill_profile(engine: LLMEngine, vocab: int, path: Path) -> None:
    """The GPU kernels of two full prefill steps (64 prompts of 512 tokens at a 16K budget)."""
    with profiled(path):
        run_engine(engine, prompts(64, 512, vocab, seed=7), 1)


def engine_section(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    torch.cuda.reset_peak_memory_stats()
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            load_format="dummy",
            max_num_seqs=256,
            max_num_batched_tokens=args.prefill_tokens,
            max_model_len=8192,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_graphs=not args.eager,
            async_scheduling=not args.no_async_scheduling,
            quantize=args.quantize,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_tail=not args.no_kv_cache_tail,
        )
    )
    if not args.no_gc_freeze:  # as the engine process does once it is ready
        freeze_startup_heap("benchmark engine")
    vocab = engine.vocab_size
    results: dict[str, float] = {
        "kv_pool_tokens": engine.num_blocks * engine.args.block_size,
        "kv_pool_gib": engine.memory_profile.kv_budget_bytes / 2**30 if engine.memory_profile else 0.0,
    }
    run_engine(engine, prompts(2, 64, vocab, seed=9), 8)  # warm-up: kernels compiled, allocator primed
    one = run_engine(engine, prompts(1, 512, vocab), 256)
    results["a_ms_per_token"] = (one["total_s"] - one["prefill_s"]) / 255 * 1e3
    results["a_ttft_s"] = one["prefill_s"]
    many = run_engine(engine, prompts(256, 512, vocab, seed=1), 128)
    results["b_total_s"] = many["total_s"]
    results["b_prefill_s"] = many["prefill_s"]
    results["b_prompt_phase_s"] = many["prompt_phase_s"]
    results["b_output_tok_s"] = many["output_tokens"] / many["total_s"]
    results["a_decode_step_ms"] = one["decode_step_s"] * 1e3
    results["b_decode_step_ms"] = many["decode_step_s"] * 1e3
    results["b_slowest_steps"] = many["slowest_steps"]
    if args.profile_dir:
        kernel_profile(engine, prompts(1, 512, vocab, seed=5), args.profile_dir / "profile-batch1.txt")
        kernel_profile(engine, prompts(256, 512, vocab, seed=6), args.profile_dir / "profile-batch256.txt")
        prefill_profile(engine, vocab, args.profile_dir / "profile-prefill.txt")
    results["d_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    results["d_device_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return results


def recording_indices(folder: Path | None) -> contextlib.AbstractContextManager:
    """Save the sparse indices of a run for kernels/bench/replay_sparse.py (folder None: nothing)."""
    if folder is None:
        return contextlib.nullcontext()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels" / "bench"))
    from replay_sparse import recording

    return recording(folder)


def long_prompt_section(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    """(c) at the default step budget: a prompt past the sparse threshold is prefilled whole, in a
    step of its own (the scheduler's whole_prompt_tokens), which sparse prefill needs."""
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            load_format="dummy",
            max_num_seqs=1,
            max_model_len=args.long_prompt + 16,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_graphs=False,
            enable_prefix_caching=False,  # each run computes its whole prompt
            quantize=args.quantize,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_tail=not args.no_kv_cache_tail,
        )
    )
    if not args.no_gc_freeze:
        freeze_startup_heap("benchmark engine")
    backend = engine.runner.forward.backend
    sparse = backend.sparse
    results = {}
    runs = (
        ("sparse", sparse),
        ("dense", None),
        ("dense", None),
        ("sparse", sparse),
    )  # first of each: warm-up
    for seed, (name, config) in enumerate(runs):
        backend.sparse = config
        long = prompts(1, args.long_prompt, engine.vocab_size, seed=10 + seed)
        results[f"c_ttft_{name}_s"] = run_engine(engine, long, 1)["prefill_s"]
    if args.profile_dir or args.save_sparse_index:  # untimed: the reported sparse run's prompt again
        backend.sparse = sparse
        profile = profiled(args.profile_dir / "profile-long-sparse.txt", 30) if args.profile_dir else None
        with profile or contextlib.nullcontext(), recording_indices(args.save_sparse_index):
            run_engine(engine, long, 1)  # no prefix cache: computed afresh
    return results


def generate_section(model_dir: Path, batch128_new: int, single_new: int) -> dict[str, float]:
    """transformers `generate` on random weights of the same shape (bf16, SDPA), greedy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    results = {}
    for batch, new in ((1, single_new), (128, batch128_new)):
        ids = torch.tensor(prompts(batch, 512, config.vocab_size, seed=3), device="cuda")
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            torch.cuda.synchronize()
        results[f"generate_b{batch}_tok_s"] = batch * new / (time.perf_counter() - start)
    return results


def report(results: dict[str, float], args: argparse.Namespace) -> str:
    r = results
    lines = [
        "# Engine on an H200: random weights at Llama-3-8B's shape, bf16",
        "",
        f"- date: {datetime.date.today()}",
        f"- commit: {_commit()}",
        f"- device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        f"- layers: {args.layers}, quantize: {args.quantize}, CUDA graphs: {not args.eager}, async scheduling: "
        f"{not args.no_async_scheduling}, prefill budget {args.prefill_tokens} tokens",
        "",
        "| measure | engine | baseline (generate, same run) | target |",
        "|---|---|---|---|",
        f"| (a) batch-1 decode, ms/token | {r['a_ms_per_token']:.2f} | "
        f"{1e3 / r['generate_b1_tok_s']:.1f} | <= 4.4 (roofline 3.86) |"
        if "generate_b1_tok_s" in r
        else f"| (a) batch-1 decode, ms/token | {r['a_ms_per_token']:.2f} | - | <= 4.4 |",
        f"| (b) 256 x (512 + 128): total s | {r['b_total_s']:.2f} (steps with prompt tokens: "
        f"{r.get('b_prompt_phase_s', float('nan')):.2f}) | - | <= 5.1 |",
        f"| (b) output tokens/s | {r['b_output_tok_s']:.0f} | "
        f"{r.get('generate_b128_tok_s', float('nan')):.0f} (batch 128) | >= 6,400 |",
    ]
    lines.append(
        f"| steady decode step, batch 1 / 256, ms | {r['a_decode_step_ms']:.2f} / {r['b_decode_step_ms']:.2f} | - | - |"
    )
    if "c_ttft_sparse_s" in r:
        lines.append(
            f"| (c) TTFT {args.long_prompt} tokens, sparse / dense s | "
            f"{r['c_ttft_sparse_s']:.2f} / {r['c_ttft_dense_s']:.2f} | - | sparse <= 4 |"
        )
    lines += [
        f"| (d) peak GPU memory GiB (of {r['d_device_gib']:.0f}) | {r['d_peak_gib']:.1f} | - | - |",
        f"| (d) KV pool tokens ({r['kv_pool_gib']:.1f} GiB) | {r['kv_pool_tokens']:,} | - | - |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--layers", type=int, default=32, help="fewer for a quick check")
    parser.add_argument("--prefill-tokens", type=int, default=16384, help="token budget of one step")
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=131072 - 128,  # 128K less room to generate: the model's context is 131,072 tokens
        help="(c) prompt length; 0 skips (c)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--quantize", choices=["fp8"], help="the engine's projections in fp8")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8: what the KV cache stores")
    parser.add_argument(
        "--no-kv-cache-tail", action="store_true", help="an 8-bit cache without its full-precision tail"
    )
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="wait for each step's tokens before the next"
    )
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the start-up heap in full garbage collections (the engine process freezes it)",
    )
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument(
        "--profile-dir", type=Path, help="write decode kernel profiles (batch 1 and 256) here"
    )
    parser.add_argument(
        "--save-sparse-index", type=Path, help="(c): save layers 0/16/30's sparse indices here"
    )
    parser.add_argument("--section", choices=["baseline", "engine", "long"], help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["baseline", "engine", "long"], help="run one section")
    args = parser.parse_args()
    if args.profile_dir:  # before the sections run, not after: a missing folder would lose their profiles
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    if args.section:  # one section in this process, its numbers as JSON on the last line
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_model_dir(Path(tmp), args.layers)
            section = {"baseline": lambda: generate_section(model_dir, 128, 64),
                       "engine": lambda: engine_section(args, model_dir),
                       "long": lambda: long_prompt_section(args, model_dir)}[args.section]  # fmt: skip
            print(json.dumps(section()), flush=True)
        return
    # Each section in its own process: the GPU starts empty for each, as a server's would.
    sections = (
        ["engine"] + ([] if args.skip_baseline else ["baseline"]) + (["long"] if args.long_prompt else [])
    )
    if args.only:
        sections = [args.only]
    results: dict[str, float] = {}
    for name in sections:
        command = [sys.executable, *sys.argv, "--section", name]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-6000:], sep="\n")
            raise SystemExit(f"section {name} failed")
        results.update(json.loads(done.stdout.strip().splitlines()[-1]))
        print(name, json.dumps(results), flush=True)
    if args.only:  # a partial run: the numbers alone
        return
    text = report(results, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today()}-engine-h200"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
