"""GPU benchmark (issue 34): one long context served end to end at Llama-3-8B's shape (dummy
weights, bf16 model), per KV cache dtype and decode attention budget: the pool, the time to the
first token of a prompt that fills the context, and the decode step over it.

A run is dtype:context[:budget]: budget 0 (the default) decodes densely, N selects N tokens of the
context for each decode query (--decode-attention-budget, threshold 32K).

Each (dtype, context) runs in its own process, so the GPU starts empty as a server's would. The
model's context is stretched to each length (`max_position_embeddings`); the prompt is the context
less the tokens generated. Decode: the median step while the request generates its last tokens, with
CUDA graphs and async scheduling as served. JSON lines, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from engine_cuda import prompts  # noqa: E402
from whole_prompt_memory_cuda import model_dir  # noqa: E402

from tgserve.server.config.engine_args import EngineArgs  # noqa: E402
from tgserve.server.engine.llm_engine import LLMEngine  # noqa: E402
from tgserve.server.protocol.params import SamplingParams  # noqa: E402

GIB = 1 << 30


def serve_one(
    context: int,
    kv_cache_dtype: str,
    budget: int,
    new_tokens: int,
    layers: int,
    utilization: float,
    profile: Path | None = None,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        engine = LLMEngine(
            EngineArgs(
                model=str(model_dir(Path(tmp), context, layers)),
                load_format="dummy",
                max_model_len=context,
                max_num_seqs=1,
                gpu_memory_utilization=utilization,
                enable_prefix_caching=False,
                kv_cache_dtype=kv_cache_dtype,
                decode_attention_budget=budget,
            )
        )
        startup = time.perf_counter() - start
    prompt = prompts(1, context - new_tokens, engine.vocab_size, seed=5)[0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(
        "long", prompt, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    )
    stamps = []
    if profile is not None:  # the prompt's step, its kernels totalled (the time to first token grows)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            while not stamps:
                if engine.step():
                    stamps.append(time.perf_counter())
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
        profile.write_text(table)
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    steps = sorted(b - a for a, b in zip(stamps[len(stamps) // 2 :], stamps[len(stamps) // 2 + 1 :]))
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "context": context,
        "decode_budget": budget,
        "pool_tokens": engine.num_blocks * engine.args.block_size,
        "prefilled_whole_from": engine.shard.whole_prompt_tokens,
        "ttft_s": round(stamps[0] - start, 2),
        "decode_ms": round(1e3 * steps[len(steps) // 2], 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "startup_s": round(startup, 1),
    }


def each_in_its_own_process(runs: list[str]) -> list[dict]:
    """This script again for each run (`--one RUN`), so the GPU starts empty for each as a server's
    would: the JSON line each prints last, echoed; a run that fails is reported and left out."""
    rows = []
    for run in runs:
        done = subprocess.run([sys.executable, *sys.argv, "--one", run], capture_output=True, text=True)
        if done.returncode != 0:
            print(run, "failed:", done.stderr[-3000:], flush=True)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", nargs="+", default=["auto:131072", "auto:131072:4096", "auto:524288",
                                                       "auto:524288:4096", "fp8:1048576:4096"],
                        help="dtype:context[:decode budget] (budget 0: dense decode)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--profile-dir", type=Path, help="write each run's prompt-step kernel totals here")
    parser.add_argument("--rescue-launch", type=json.loads, default={},
                        help='JSON over the rescue estimate\'s launch (kernels/sparse/pooled.LAUNCH), e.g. '
                             '\'{"split_dots": false}\'')  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        from tgserve.kernels.sparse import pooled

        pooled.LAUNCH.update(args.rescue_launch)
        dtype, context, budget = (args.one + ":0").split(":")[:3]
        profile = None
        if args.profile_dir:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            profile = args.profile_dir / f"prompt-step-{dtype}-{context}-{budget}.txt"
        result = serve_one(
            int(context),
            dtype,
            int(budget),
            args.new_tokens,
            args.layers,
            args.gpu_memory_utilization,
            profile,
        )
        print(json.dumps(result), flush=True)
        return
    rows = each_in_its_own_process(args.runs)
    print("| KV cache | context | decode budget | pool tokens | prefilled whole from | TTFT s | decode ms/token "
          "| peak GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['context']:,} | {r['decode_budget'] or 'dense'} | {r['pool_tokens']:,} | "
              f"{r['prefilled_whole_from']} | {r['ttft_s']} | {r['decode_ms']} | {r['peak_gib']} |")  # fmt: skip


if __name__ == "__main__":
    main()
