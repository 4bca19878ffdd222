"""Sparse prefill accuracy on structured prompts: tgserve's estimate, MInference's, and the block
oracle at tgserve's cost, side by side on the same inputs.

    python kernels/bench/sparse_structured_accuracy.py --n 32768 131072 --out docs/benchmarks
    python kernels/bench/sparse_structured_accuracy.py --device cuda --n 131072 524288 --heads 32 --kv-heads 8

Inputs: `synthetic.structured_prompt` families (rotary diagonals at real RoPE frequencies or exact
harmonics, 16 sinks, 64 heavy hitters, 15 needles: 5 depths x 16 / 64 / 512 seekers). Errors are
against dense fp32 attention on 32 sampled query blocks (and every needle's seekers), see
`sparse/accuracy.py`. Cost is the share of the causal 64 x 64 tiles a method computes. MInference is
the torch re-implementation in `sparse/minference_baseline.py` at its default 1000 / 6096 budget.
"tgserve + tail" (not in the default set) is tgserve's index with the blocks it skips folded back
in as one summarised key per query block (`sparse/tail.py`). "bands (mixed)" and "bands (greedy)"
(not in it either) are tgserve's index with its block diagonals replaced by token-shift bands at
the same budget, accuracy models ahead of a kernel (`sparse/shifted_bands.py`): bands for isolated
peaks only, or everywhere.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tgserve.kernels.sparse import minference_baseline as minference
from tgserve.kernels.sparse.accuracy import Report, TailedMasks, oracle, score
from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.index import index_to_mask
from tgserve.kernels.sparse.shifted_bands import BandedMasks
from tgserve.kernels.sparse.synthetic import STRUCTURES, structured_prompt
from tgserve.kernels.sparse.tail import skipped_tail
from tgserve.kernels.sparse.tail_kernel import skipped_tail_triton

METHODS = [
    "tgserve",
    "MInference",
    "block oracle",
    "tgserve + tail",
    "tgserve + tail (log-normal)",
    "bands (mixed)",
    "bands (greedy)",
]


def row(n: int, family: str, method: str, report: Report, tile_share: float) -> str:
    kept = sum(r >= 0.9 for _, _, r, _ in report.needles)
    few = [r for _, count, r, _ in report.needles if count <= 16]
    worst = max(err for *_, err in report.needles)
    quartiles = " / ".join(f"{q:.3f}" for q in report.quartiles)
    return (f"| {n} | {family} | {method} | {report.rel_l2:.4f} | {quartiles} | {report.mass:.4f} "
            f"| {tile_share:.3f} | {kept}/{len(report.needles)} | {sum(r >= 0.9 for r in few)}/{len(few)} "
            f"| {worst:.3f} |")  # fmt: skip


def bands_model(prompt, index, pattern: HeadPattern, mixed: bool) -> tuple[BandedMasks, float]:
    """tgserve's index with its block diagonals as token-shift bands (`sparse/shifted_bands.py`)."""
    masks = BandedMasks.from_index(prompt.query, prompt.key, prompt.scale, index, pattern, mixed)
    return masks, float(masks.tiles_per_block().sum())


def tailed(prompt, index, per_block: torch.Tensor, spread: bool) -> tuple[TailedMasks, float]:
    """tgserve's index with the blocks it skips folded back in (`sparse/tail.py`), at its cost."""
    on_gpu = prompt.query.is_cuda  # the Triton tail there, as sparse_prefill runs it
    tail = (skipped_tail_triton if on_gpu else skipped_tail)(
        prompt.query, prompt.key, prompt.value, index, prompt.scale, spread=spread
    )
    return TailedMasks(lambda rows: index_to_mask(index, rows), tail, index.block), float(per_block.sum())


def compare(n: int, family: str, args: argparse.Namespace) -> list[str]:
    gpu = args.device == "cuda"
    prompt = structured_prompt(n, args.heads, args.kv_heads, 128, args.seed, STRUCTURES[family],
                               torch.bfloat16 if gpu else torch.float32, args.device)  # fmt: skip
    patterns = [args.pattern] * args.heads
    causal_tiles = args.heads * (n // 64) * (n // 64 + 1) / 2
    index = estimate_index(prompt.query, prompt.key, prompt.scale, patterns, use_triton=gpu)
    per_block = index.tiles_per_block()
    theirs = (
        minference.minference_index(prompt.query, prompt.key, prompt.scale)
        if "MInference" in args.methods
        else None
    )
    methods = {
        "tgserve": (lambda rows: index_to_mask(index, rows), float(per_block.sum())),
        "MInference": (minference.KeptMasks(theirs), float(minference.tiles_per_block(theirs).sum()))
        if theirs is not None
        else None,
        "block oracle": (oracle(prompt, per_block), float(per_block.sum())),
        "tgserve + tail": tailed(prompt, index, per_block, spread=False)
        if "tgserve + tail" in args.methods
        else None,
        "tgserve + tail (log-normal)": tailed(prompt, index, per_block, spread=True)
        if "tgserve + tail (log-normal)" in args.methods
        else None,
        "bands (mixed)": bands_model(prompt, index, args.pattern, True)
        if "bands (mixed)" in args.methods
        else None,
        "bands (greedy)": bands_model(prompt, index, args.pattern, False)
        if "bands (greedy)" in args.methods
        else None,
    }
    lines = []
    for method in args.methods:
        mask_of, tiles = methods[method]
        start = time.time()
        report = score(prompt, mask_of, blocks=args.blocks)
        lines.append(row(n, family, method, report, tiles / causal_tiles))
        print(lines[-1], f"({time.time() - start:.0f} s)", flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, nargs="*", default=[32768])
    parser.add_argument("--families", nargs="*", default=list(STRUCTURES))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=32, help="query blocks sampled per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="*", default=METHODS[:3], choices=METHODS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pattern", type=lambda text: HeadPattern(**json.loads(text)), default=HeadPattern(),
                        help='every head\'s pattern fields, e.g. \'{"vertical": 512}\' (default: the default pattern)')  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    lines = ["| tokens | family | method | rel L2 | by quarter | mass | tiles | needles kept | 16-seeker "
             "needles | worst needle rows' rel L2 |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    print("\n".join(lines), flush=True)
    for n in args.n:
        for family in args.families:
            lines += compare(n, family, args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"sparse_structured_accuracy_{args.device}_{'_'.join(map(str, args.n))}.md"
        (args.out / name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
