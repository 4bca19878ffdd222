"""GPU benchmark (issue 35): long contexts that together outgrow the GPU's KV pool, served with
the long-context tier (`--kv-offload-gb`), at Llama-3-8B's shape (dummy weights, bf16).

A run is contexts x context[:offload GiB[:pool blocks]]: that many requests of `context` tokens
each (prompt and output) submitted at once, with selective decode attention (--budget); offload 0
turns the host tier off (the baseline: a context that fits, alone). Pool blocks caps the pool
(0: sized from GPU memory), to make small runs spill.

Reported per run: the pool and host tier in tokens, the device blocks of the host blocks' key copies
and of the hot-block cache (`--key-copy-share`, `--hot-block-share`: 0 turns either off) and the
share of chosen host blocks the cache served, each request's time to first token, the median
decode step while every request decodes (each step gives each of them a token), and the blocks
spilled to host, and how each request finished. Where the pool and host tier together cannot hold
every context, a request waits for another to finish instead of spilling: no step has them all
decoding and the decode time is None (2 x 512K needs 66 GiB of host tier beside the default
hot-block and key-copy shares). Each run is its own process, so the GPU starts empty as a server's
would.
JSON lines, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from engine_cuda import prompts  # noqa: E402
from long_context_cuda import each_in_its_own_process  # noqa: E402
from whole_prompt_memory_cuda import model_dir  # noqa: E402

from tgserve.server.config.engine_args import EngineArgs  # noqa: E402
from tgserve.server.engine.llm_engine import LLMEngine  # noqa: E402
from tgserve.server.protocol.params import SamplingParams  # noqa: E402


def serve(contexts: int, context: int, offload_gib: float, num_blocks: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        engine = LLMEngine(
            EngineArgs(
                model=str(model_dir(Path(tmp), context, args.layers)),
                load_format="dummy",
                max_model_len=context,
                max_num_seqs=contexts,
                gpu_memory_utilization=args.gpu_memory_utilization,
                num_blocks=num_blocks or None,
                enable_prefix_caching=False,
                decode_attention_budget=args.budget,
                kv_offload_gb=offload_gib,
            )
        )
        startup = time.perf_counter() - start
        if engine.shard.host_pool is not None:  # the pinning runs in the background: wait for all of it
            engine.shard.host_pool.wait_until_pinned()
            engine.step()  # the engine hands the pinned blocks to the scheduler as it steps
        batch = prompts(contexts, context - args.new_tokens, engine.vocab_size, seed=5)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{i}", prompt, params)
        first: dict[str, float] = {}
        finished: dict[str, tuple] = {}  # request id: (finish reason, output tokens)
        all_decoding: list[float] = []  # step ends once every request has its first token
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                first.setdefault(out.request_id, now - start)
                if out.finished:
                    finished[out.request_id] = (out.finish_reason, out.num_output_tokens)
            if len(first) == contexts and engine.scheduler.num_running == contexts:
                all_decoding.append(now)
        stats = engine.stats()
        steps = sorted(b - a for a, b in zip(all_decoding[1:], all_decoding[2:]))
        block = engine.args.block_size
        host = engine.shard.host_pool
        return {
            "contexts": contexts,
            "context": context,
            "budget": args.budget,
            "candidates": engine.shard.selection.candidates,
            "pool_tokens": engine.num_blocks * block,
            "host_tokens": 0 if host is None else host.num_blocks * block,
            "key_copies": engine.shard.key_copy_slots or 0,
            "hot_slots": engine.shard.hot_slots or 0,
            "hot_hit_rate": hot_hit_rate(host),
            "ttft_s": [round(first[f"r{i}"], 2) for i in range(contexts)],
            "decode_ms": round(1e3 * steps[len(steps) // 2], 3) if steps else None,
            "decode_steps": len(steps),
            "finished": [finished.get(f"r{i}") for i in range(contexts)],
            "spilled_blocks": stats.host_spilled_blocks,
            "preemptions": stats.num_preemptions,
            "startup_s": round(startup, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        }


def hot_hit_rate(host) -> float | None:
    """The share of chosen host blocks read from the hot-block cache over the run (None: no cache)."""
    if host is None or host.hot_blocks is None:
        return None
    hits, misses = host.hot_blocks.counts()
    return round(hits / max(1, hits + misses), 3)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", nargs="+", default=["1x524288", "2x524288:66"],
                        help="contexts x context[:offload GiB[:pool blocks]]")  # fmt: skip
    parser.add_argument("--budget", type=int, default=4096, help="--decode-attention-budget")
    parser.add_argument(
        "--candidates", type=int, help="blocks scored exactly per block chosen (default: the engine's)"
    )
    parser.add_argument(
        "--key-copy-share", type=float,
        help="the most of the KV budget the host blocks' key copies take (default: the engine's; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--hot-block-share", type=float,
        help="the most of the KV budget the hot-block cache takes (default: the engine's; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--hot-admission", choices=["torch", "kernel"],
        help="the hot-block cache's admission: torch's small kernels or one Triton launch a layer (default: the engine's)",
    )  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        if args.candidates:  # a design parameter, not a flag: the selection's, replaced for this run
            import dataclasses

            from tgserve.kernels.decode_selection import DecodeSelection

            made = DecodeSelection.for_budget.__func__
            DecodeSelection.for_budget = classmethod(
                lambda cls, *a: dataclasses.replace(made(cls, *a), candidates=args.candidates)
            )
        if args.key_copy_share is not None:  # likewise
            from tgserve.server.engine import model_shard

            model_shard.KEY_COPY_SHARE = args.key_copy_share
        if args.hot_block_share is not None:
            from tgserve.server.engine import model_shard

            model_shard.HOT_BLOCK_SHARE = args.hot_block_share
        if args.hot_admission is not None:
            from tgserve.server.kv_cache import hot_blocks

            hot_blocks.ADMIT_IN_ONE_KERNEL = args.hot_admission == "kernel"
        shape, *rest = args.one.split(":")
        contexts, context = (int(n) for n in shape.split("x"))
        offload, blocks = (rest + ["0", "0"])[:2]
        print(json.dumps(serve(contexts, context, float(offload), int(blocks), args)), flush=True)
        return
    rows = each_in_its_own_process(args.runs)
    print(
        "| contexts | context | pool tokens | host tokens | key copies | hot blocks | hot hit rate | TTFT s "
        "| decode ms/step | spilled blocks | preemptions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['contexts']} | {r['context']:,} | {r['pool_tokens']:,} | {r['host_tokens']:,} | {r['key_copies']:,} | "
              f"{r['hot_slots']:,} | {r['hot_hit_rate']} | {', '.join(map(str, r['ttft_s']))} | {r['decode_ms']} | "
              f"{r['spilled_blocks']:,} | {r['preemptions']} |")  # fmt: skip


if __name__ == "__main__":
    main()
