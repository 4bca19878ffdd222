"""Selective decode's parts on a GPU, one layer at Llama-3-8B's shape (32 query / 8 KV heads of 128,
bf16, batch 1): the block bounds, the top candidates, their exact scores, the top chosen, the decode
kernel over the chosen blocks, against dense decode over the whole context. Each op is captured 32
times in a CUDA graph (a decode step's layers) and timed by replay, so launch costs count as they do
when served."""

from __future__ import annotations

import argparse

import torch
from bench_decode_splits import CACHE_DTYPES  # this folder's cache dtypes
from bench_gemv import graph_us  # this folder's graph timing

from tgserve.kernels import dispatch
from tgserve.kernels.block_scores import block_scores, candidate_scores
from tgserve.kernels.decode_selection import DecodeSelection, choose_blocks
from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.testing import quantized_cache


def graphed_us(fn, layers: int = 32, replays: int = 20) -> float:
    """Microseconds per call of fn, captured `layers` times in one graph (a decode step's layers)."""
    return graph_us([fn] * layers, replays)


def measure(context: int, selection: DecodeSelection, cache_dtype: torch.dtype) -> str:
    """One context's table row, the cache stored as `cache_dtype` (8-bit: as the pool stores it)."""
    dev, bs, heads, kv_heads, dim = "cuda", 16, 32, 8, 128
    blocks = context // bs
    cache = torch.randn(2, blocks, bs, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    scale = None
    if cache_dtype != torch.bfloat16:
        cache, scale = quantized_cache(cache, cache_dtype)
    summary = torch.randn(2, blocks, kv_heads, dim, device=dev, dtype=torch.bfloat16).sort(0).values
    table = torch.randperm(blocks, device=dev, dtype=torch.int32)[None]
    seq_lens = torch.tensor([context], device=dev, dtype=torch.int32)
    query = torch.randn(1, heads, dim, device=dev, dtype=torch.bfloat16)
    k, c = selection.chosen_blocks(bs, blocks), selection.candidate_blocks(bs, blocks)
    score_args = (query, summary, table, seq_lens, bs, selection.sink_blocks(bs), selection.recent_blocks(bs))
    bound = block_scores(*score_args)
    candidates = torch.topk(bound, c, dim=-1, sorted=False).indices
    exact = candidate_scores(query, cache, table, candidates, bound, scale)
    chosen = candidates.gather(2, choose_blocks(exact, k))
    lengths = selection.lengths(seq_lens, bs, blocks)
    out = torch.empty_like(query)

    def decode(selected: tuple | None, bound: int) -> None:
        paged_decode(query, cache, table, seq_lens, 0.1, out=out, max_seq_len=bound, kv_scale=scale,
                     selection=selected)  # fmt: skip

    def whole() -> None:
        chosen = dispatch.select_decode_blocks(query, summary, table, seq_lens, selection, cache, scale)
        decode((chosen, lengths), 32768)

    times = [
        graphed_us(lambda: block_scores(*score_args)),
        graphed_us(lambda: torch.topk(bound, c, dim=-1, sorted=False)),
        graphed_us(lambda: candidate_scores(query, cache, table, candidates, bound, scale)),
        graphed_us(lambda: candidates.gather(2, choose_blocks(exact, k))),
        graphed_us(lambda: decode((chosen, lengths), 32768)),
        graphed_us(lambda: decode(None, context)),
        graphed_us(whole),
    ]
    return f"| {context:,} | " + " | ".join(f"{t:.1f}" for t in times) + " |"


def sweep_scores(context: int, selection: DecodeSelection) -> None:
    """The block-score kernel's tiles at one context: microseconds a layer, and the summaries'
    bytes over that time."""
    dev, bs, heads, kv_heads, dim = "cuda", 16, 32, 8, 128
    blocks = context // bs
    summary = torch.randn(2, blocks, kv_heads, dim, device=dev, dtype=torch.bfloat16).sort(0).values
    table = torch.randperm(blocks, device=dev, dtype=torch.int32)[None]
    seq_lens = torch.tensor([context], device=dev, dtype=torch.int32)
    query = torch.randn(1, heads, dim, device=dev, dtype=torch.bfloat16)
    args = (query, summary, table, seq_lens, bs, selection.sink_blocks(bs), selection.recent_blocks(bs))
    print(f"| block scores at {context:,}: blocks a program | warps | us | TB/s |")
    print("|---|---|---|---|")
    for block_j in (32, 64, 128, 256):
        for warps in (2, 4, 8):
            us = graphed_us(lambda j=block_j, w=warps: block_scores(*args, block_j=j, num_warps=w))
            print(f"| {block_j} | {warps} | {us:.1f} | {summary.nbytes / us / 1e6:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--kv-cache-dtype", choices=CACHE_DTYPES, default="bf16")
    parser.add_argument(
        "--sweep", action="store_true", help="the block-score kernel's tiles at the last context"
    )
    args = parser.parse_args()
    selection = DecodeSelection.for_budget(args.budget, 32768)
    if args.sweep:
        sweep_scores(args.contexts[-1], selection)
        return
    print("| context | bound us | top candidates us | candidate scores us | top chosen us | selected decode us "
          "| dense decode us | all selection us |")  # fmt: skip
    print("|---" * 8 + "|")
    for context in args.contexts:
        print(measure(context, selection, CACHE_DTYPES[args.kv_cache_dtype]), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
