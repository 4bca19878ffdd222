"""Decode attention over an 8-bit cache with and without the full-precision tail, same run.

    python kernels/bench/bench_decode_tail.py

32 query / 8 KV heads of 128 (Llama-3-8B's layer), bf16 queries, 16-token pages, an e4m3 cache;
each launch stores the step's key and value, as the engine's decode does. With the tail every
sequence's current block has a slot (`server/kv_cache/tail_blocks.py`): the kernel reads that block
from it and stores the step's row there too. Times by `triton.testing.do_bench` (median), each
variant ROUNDS times interleaved, the fastest kept; prints us a launch.
"""

from __future__ import annotations

import torch
import triton

from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.testing import quantized_cache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CASES = ((256, 640), (64, 2048), (16, 7000), (1, 8192), (1, 131072))
ROUNDS = 4  # each variant's median this many times, interleaved; the fastest kept


def case(batch: int, context: int) -> tuple[float, float]:
    """(us without the tail, us with it) for `batch` sequences of `context` tokens."""
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv_cache, kv_scale = quantized_cache(cache)
    del cache
    order = torch.randperm(num_blocks - 1, device="cuda")[: batch * per_seq]
    tables = order.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    key, value = (
        torch.randn(batch, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    current = tables[:, (context - 1) // BLOCK].long()
    slots = current * BLOCK + (context - 1) % BLOCK
    tail_cache = torch.randn(2, batch, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slot_of = torch.full((num_blocks,), -1, dtype=torch.int32, device="cuda")
    slot_of[current] = torch.arange(batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    best = {}
    for name, tail in (("none", None), ("tail", (tail_cache, slot_of))) * ROUNDS:

        def launch(tail=tail):
            paged_decode(query, kv_cache, tables, seq_lens, 0.088, out=out, max_seq_len=context,
                         step_kv=(key, value, slots), kv_scale=kv_scale, tail=tail)  # fmt: skip

        launch()
        us = triton.testing.do_bench(launch, warmup=50, rep=200, return_mode="median") * 1e3
        best[name] = min(us, best.get(name, us))
    return best["none"], best["tail"]


def main() -> None:
    print("| batch | context | no tail, us | tail, us | ratio |\n|---|---|---|---|---|")
    for batch, context in CASES:
        none, tail = case(batch, context)
        print(f"| {batch} | {context} | {none:.1f} | {tail:.1f} | {tail / none:.3f} |", flush=True)


if __name__ == "__main__":
    main()
