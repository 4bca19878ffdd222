"""GPU benchmark (issue 35): the host tier of the prefix cache (--kv-offload-gb), beside its baselines.

    python benchmarks/host_tier_cuda.py [--conversations 32 --prefix-tokens 16384 --offload-gb 70]

Measures, in one run, at Llama-3-8B's shape with random weights (`load_format="dummy"`), bf16:
  (1) copies: a plain pinned host <-> device copy of 1 GiB, and the host pool's offloads and loads of
      256 blocks (one contiguous row a block across all layers), in GB/s;
  (2) a multi-turn workload: `--conversations` conversations, each its own `--prefix-tokens`-token
      system prompt, in a KV pool of a third of their prefixes; every conversation's first turn
      once, then every second turn (the first turn's prompt, its answer and a new question) one at a
      time, timed to its first token; then all second turns at once, timed to the last token. Once
      with the tier (prefixes evicted from the pool come back from host memory) and once without
      (they are recomputed), each in a process of its own.
Prints a Markdown report and writes it under --out. `--tiny` runs the same code on the CPU with the
tiny fixture model and short prompts (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.core.host_tier import KVTransfers
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.kv_cache.host_pool import HostKVPool
from tgserve.server.protocol.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cuda import write_model_dir  # noqa: E402  (this folder's helper)

ANSWER_TOKENS = 16


def copy_section(device: torch.device, layers: int, heads: int = 8, head_dim: int = 128) -> dict[str, float]:
    """GB/s of plain pinned copies and of the host pool's block transfers (blocks of 16 tokens)."""
    results = _plain_copies(1 << 30 if device.type == "cuda" else 1 << 24, device)
    blocks = 512 if device.type == "cuda" else 16
    pool = [
        torch.zeros(2, blocks, 16, heads, head_dim, dtype=torch.bfloat16, device=device)
        for _ in range(layers)
    ]
    host_pool = HostKVPool(pool, blocks // 2, device)
    moved = blocks // 2
    offloads = KVTransfers(offloads=[(2 * i, i) for i in range(moved)])  # every other block
    loads = KVTransfers(loads=[(i, 2 * i + 1) for i in range(moved)])
    nbytes = moved * host_pool.block_bytes

    def offload() -> None:
        host_pool.apply(offloads)
        if host_pool.stream is not None:
            torch.cuda.current_stream(device).wait_stream(host_pool.stream)

    results["block_bytes"] = host_pool.block_bytes
    results["offload_gbs"] = nbytes / _seconds(offload, device) / 1e9
    results["load_gbs"] = nbytes / _seconds(lambda: host_pool.apply(loads), device) / 1e9
    return results


def _plain_copies(size: int, device: torch.device) -> dict[str, float]:
    """GB/s of one copy of `size` bytes between pinned host memory and the device, each way."""
    gpu = torch.empty(size, dtype=torch.uint8, device=device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return {
        "plain_h2d_gbs": size / _seconds(lambda: gpu.copy_(host, non_blocking=True), device) / 1e9,
        "plain_d2h_gbs": size / _seconds(lambda: host.copy_(gpu, non_blocking=True), device) / 1e9,
    }


def _seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of fn() run to completion on the device."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def conversations(count: int, prefix: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """Per conversation: its system prompt plus first question, and its second question."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, vocab, (count, prefix + 96), generator=generator).tolist()
    return [(row[: prefix + 32], row[prefix + 32 :]) for row in tokens]


def first_token_s(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds from submitting `prompt` alone to its first token, and its answer's tokens."""
    params = SamplingParams(temperature=0.0, max_new_tokens=ANSWER_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first, answer = None, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            answer += output.new_token_ids
            if first is None and answer:
                first = time.perf_counter() - start
    return first, answer


def workload_section(args: argparse.Namespace, model: str, offload_gb: float) -> dict[str, float]:
    """The multi-turn workload on one engine (in this process)."""
    block = 16
    pool_blocks = args.conversations * args.prefix_tokens // (3 * block)
    engine = LLMEngine(
        EngineArgs(
            model=model,
            load_format="auto" if args.tiny else "dummy",
            num_blocks=pool_blocks,
            block_size=block,
            max_num_batched_tokens=args.prefix_tokens + 256,
            max_model_len=args.prefix_tokens + 512,
            kv_offload_gb=offload_gb,
            sparse_prefill=False,
        )
    )
    turns = conversations(args.conversations, args.prefix_tokens, engine.vocab_size)
    answers = [first_token_s(engine, f"first-{i}", first)[1] for i, (first, _) in enumerate(turns)]
    seconds = []
    second_prompts = []
    for i, ((first, question), answer) in enumerate(zip(turns, answers, strict=True)):
        prompt = first + answer + question
        second_prompts.append(prompt)
        seconds.append(first_token_s(engine, f"second-{i}", prompt)[0])
    params = SamplingParams(temperature=0.0, max_new_tokens=ANSWER_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(second_prompts):  # again, all at once: the pool holds a third of them
        engine.add_request(f"batch-{i}", prompt + [101], params)
    while engine.has_unfinished_requests():
        engine.step()
    batch_s = time.perf_counter() - start
    stats = engine.stats()
    seconds.sort()
    return {
        "pool_tokens": pool_blocks * block,
        "host_blocks": stats.host_num_total_blocks,
        "second_turn_ttft_median_s": seconds[len(seconds) // 2],
        "second_turn_ttft_p90_s": seconds[int(len(seconds) * 0.9)],
        "all_second_turns_s": batch_s,
        "host_prefix_hits": stats.host_prefix_hits,
        "prefix_cache_hits": stats.prefix_cache_hits,
    }


def report(args: argparse.Namespace, copies: dict, on: dict, off: dict) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"# Host tier of the prefix cache ({datetime.date.today()}, {commit}, {device})",
        "",
        (
            "The tiny fixture model on the CPU (a check of the script)"
            if args.tiny
            else f"Llama-3-8B's shape, {args.layers} layers, bf16, dummy weights"
        )
        + f"; {args.conversations} conversations of {args.prefix_tokens}-token system prompts, a KV pool of "
        f"{on['pool_tokens']} tokens, a host tier of {on['host_blocks']} blocks.",
        "",
        "| copies | GB/s |",
        "|---|---|",
        f"| plain pinned host -> device, 1 GiB | {copies['plain_h2d_gbs']:.1f} |",
        f"| plain pinned device -> host, 1 GiB | {copies['plain_d2h_gbs']:.1f} |",
        f"| host pool loads, blocks of {copies['block_bytes'] / 2**20:.2f} MiB | {copies['load_gbs']:.1f} |",
        f"| host pool offloads | {copies['offload_gbs']:.1f} |",
        "",
        "| multi-turn | tier on | tier off (recompute) |",
        "|---|---|---|",
    ]
    for key in ("second_turn_ttft_median_s", "second_turn_ttft_p90_s", "all_second_turns_s", "host_prefix_hits",
                "prefix_cache_hits"):  # fmt: skip
        lines.append(f"| {key} | {on[key]:.3f} | {off[key]:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--offload-gb", type=float, default=70.0, help="the tier's size when on")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="the CPU and the tiny fixture: checks the script")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)  # one workload run, this tier size
    args = parser.parse_args()
    if args.tiny:
        from tgserve.server.testing.fixtures import fixture_path

        model = str(fixture_path("llama"))
    else:
        model = str(write_model_dir(Path(tempfile.mkdtemp()), args.layers))
    if args.one is not None:
        print(json.dumps(workload_section(args, model, args.one)))
        return
    device = torch.device("cpu" if args.tiny else "cuda")
    copies = copy_section(device, 2 if args.tiny else args.layers)
    runs = {}
    for name, gib in (("on", args.offload_gb), ("off", 0.0)):  # each in its own process: a fresh GPU
        command = [sys.executable, __file__, *sys.argv[1:], "--one", str(gib)]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        runs[name] = json.loads(output.strip().splitlines()[-1])
    text = report(args, copies, runs["on"], runs["off"])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "cpu-check" if args.tiny else "h200"
    (args.out / f"{datetime.date.today()}-host-tier-{suffix}.md").write_text(text)


if __name__ == "__main__":
    main()
