"""Where sparse prefill time goes on a GPU: estimation stage by stage, and launch configurations.

    python kernels/bench/profile_sparse.py --n 131072 524288 --sweep 131072

Default pattern (vertical-slash 1000/6096, rescue 3 with 1 by the range) on every head of a planted prompt, batch 1,
32 query heads, 8 KV heads, head_dim 128, bf16. Prints one line per stage (median ms) and, at the
--sweep lengths, the time of each kernel under a few (block, warps, stages) launch settings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_attention import timed_ms  # this script's folder is on sys.path when run as a script

from tgserve.kernels.sparse import estimate, kernel, lastq, pooled, tail_kernel
from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.config import SparseConfig
from tgserve.kernels.sparse.index import build_index
from tgserve.kernels.sparse.synthetic import planted_prompt

HEADS, KV_HEADS, DIM, DTYPE = 32, 8, 128, torch.bfloat16


def stages(n: int, iters: int, sweep: bool) -> dict[str, float]:
    config = SparseConfig()
    pat, block = config.default, config.block
    p = planted_prompt(n, HEADS, KV_HEADS, DIM, seed=0, dtype=DTYPE, device="cuda")
    q, k, v, scale = p.query, p.key, p.value, p.scale
    heads = list(range(HEADS))

    def t(fn):
        return timed_ms(fn, warmup=1, iters=iters)

    row: dict[str, float] = {}
    vertical, diagonal = lastq.last_q_scores_triton(q, k, heads, scale, config.last_q, block)
    row["last_q_scores"] = t(lambda: lastq.last_q_scores_triton(q, k, heads, scale, config.last_q, block))
    cols = estimate.top_with_forced(vertical, [pat.vertical] * HEADS, [pat.sink] * HEADS)
    row["top_verticals"] = t(
        lambda: estimate.top_with_forced(vertical, [pat.vertical] * HEADS, [pat.sink] * HEADS)
    )
    budget, forced = [-(-pat.slash // block)] * HEADS, [-(-pat.local // block) + 1] * HEADS
    cover = estimate.top_diagonals(diagonal, budget, forced)
    row["top_diagonals"] = t(lambda: estimate.top_diagonals(diagonal, budget, forced))
    row["block_means"] = t(lambda: estimate.block_means(q, block))
    rescue = [pat.rescue - pat.rescue_range] * HEADS
    picks = pooled.rescue_blocks_triton(q, k, heads, block, cover, None, cols, rescue)
    row["rescue"] = t(lambda: pooled.rescue_blocks_triton(q, k, heads, block, cover, None, cols, rescue))
    by_range = [max(1, pat.rescue_range)] * HEADS
    row["rescue by range"] = t(
        lambda: pooled.rescue_blocks_triton(
            q, k, heads, block, cover, picks, cols, by_range, query_range=True
        )
    )
    blocks = estimate.share_neighbours(picks)
    row["build_index"] = t(lambda: build_index(n, block, cover, blocks, cols))
    patterns = config.head_patterns(0, HEADS, seq_len=n)  # past range_max_len: no range blocks
    index = estimate_index(q, k, scale, patterns, block, config.last_q, use_triton=True)
    row["estimate_total"] = t(
        lambda: estimate_index(q, k, scale, patterns, block, config.last_q, use_triton=True)
    )
    row["kernel"] = t(lambda: kernel.sparse_attention_kernel(q, k, v, index, scale))
    row |= tail_stages(q, k, v, index, scale, t)
    if sweep:
        saved = dict(kernel.LAUNCH)
        for launch in ({"num_stages": 3}, {"num_stages": 1}, {"num_warps": 8}):
            kernel.LAUNCH.update(launch)
            row[f"kernel {launch}"] = t(lambda: kernel.sparse_attention_kernel(q, k, v, index, scale))
            kernel.LAUNCH.update(saved)
        saved = dict(pooled.LAUNCH)
        for launch in ({"block_r": 128, "num_warps": 8}, {"block_r": 64, "num_warps": 4},
                       {"block_r": 128, "num_warps": 8, "num_stages": 4}, {"key_blocks": 2},
                       {"key_blocks": 2, "num_warps": 8}, {"key_blocks": 2, "num_stages": 2},
                       {"split_dots": False}, {"num_stages": 3},
                       {"key_blocks": 4}):  # fmt: skip
            pooled.LAUNCH.update(launch)
            row[f"rescue {launch}"] = t(
                lambda: pooled.rescue_blocks_triton(q, k, heads, block, cover, None, cols, rescue)
            )
            pooled.LAUNCH.update(saved)
        lastq.LAUNCH.update({"num_warps": 8})
        row["last_q_scores {'num_warps': 8}"] = t(
            lambda: lastq.last_q_scores_triton(q, k, heads, scale, config.last_q, block)
        )
        lastq.LAUNCH.update({"num_warps": 4})
    return row


def tail_stages(q, k, v, index, scale: float, t) -> dict[str, float]:
    """The tail (`"tail": true`) stage by stage: the key blocks' summaries (torch, all heads at
    once), the block-mean queries, the streaming kernel, the whole tail, and pass 2 folding it."""
    tail = tail_kernel.skipped_tail_triton(q, k, v, index, scale)
    return {
        "tail: key block summaries": t(lambda: tail_kernel.stacked_summaries(k, v, index, spread=False)),
        "tail: block-mean queries": t(
            lambda: estimate.block_means(q, index.block).transpose(0, 1).contiguous()
        ),
        "tail: whole (summaries, queries, kernel)": t(
            lambda: tail_kernel.skipped_tail_triton(q, k, v, index, scale)
        ),
        "kernel folding the tail": t(
            lambda: kernel.sparse_attention_kernel(q, k, v, index, scale, tail=tail)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, nargs="*", default=[131072])
    parser.add_argument("--sweep", type=int, nargs="*", default=[])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for n in args.n:
        results[n] = stages(n, args.iters, n in args.sweep)
        for name, ms in results[n].items():
            print(f"{n:>8} {name:<55} {ms:8.2f} ms", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_sparse.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
