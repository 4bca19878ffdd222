"""Decode attention against its context-split count, as the engine runs it (CUDA graphs).

    python kernels/bench/bench_decode_splits.py --batch 4 8 16 --context 1000 7000 --splits 3 4 5 8 16
    python kernels/bench/bench_decode_splits.py --batch 256 --context 640 --splits --kv-cache-dtype bf16 fp8 int8

For each batch size and context length: one CUDA graph of 32 launches (one per layer, cycling over
CACHES caches), timed over 20 replays by bench_gemv's `graph_us`; prints the mean us a launch for
the automatic split count (`decode_launch.choose_splits` at --bound, the context bound the engine's
decode graphs are captured with) and for each forced count. 32 query / 8 KV heads of
128, bf16 queries, 16-token pages; the cache bf16 or 8-bit (`--kv-cache-dtype`, the engine's
names). Every row's output is checked against the torch twin.

Each launch stores the step's key and value first, as the engine's does. Without that store the
kernel is another compile, and the split counts fastest for it made the engine's decode step up to
15% slower at batches 2-16 (docs/benchmarks/2026-11-30-pool-at-defaults-and-decode-probes-h200.md).
Confirm a new choice in the engine itself before keeping it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_gemv import graph_us  # this script's folder is on sys.path when run as a script

from tgserve.kernels import reference
from tgserve.kernels.decode_launch import choose_splits, launch_tile
from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import INT8, dequantize_kv
from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.testing import max_abs_err, quantized_cache

HEADS, KV_HEADS, DIM, PAGE, LAYERS = 32, 8, 128, 16, 32
# Distinct caches the layers cycle through. Where four contexts' worth of keys and values fit in the
# 50 MB L2 (batch x context under about 3,000 tokens), a launch may find its cache still there, as
# the engine's never does (its weights pass through between layers): those rows run warm.
CACHES = 4
REPLAYS = 20
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8, "int8": INT8}


class DecodeStep:
    """A decode step's inputs for `batch` sequences of `context` tokens, pages scattered at random."""

    def __init__(self, batch: int, context: int, bound: int, cache_dtype: torch.dtype) -> None:
        pages = batch * -(-max(bound, context) // PAGE)
        self.caches, self.scales = [], []
        for _ in range(CACHES):
            cache = torch.randn(2, pages, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
            if cache_dtype == torch.bfloat16:
                self.caches.append(cache)
                self.scales.append(None)
                continue
            rows, scale = quantized_cache(cache, cache_dtype)
            self.caches.append(rows)
            self.scales.append(scale)
            del cache
        self.block_tables = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, -1)
        self.seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        self.queries = [
            torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)
        ]
        self.outs = [torch.empty_like(q) for q in self.queries]
        # As in the engine, the kernel stores the step's key and value (at the last position) first.
        last = context - 1
        slots = self.block_tables[:, last // PAGE].long() * PAGE + last % PAGE
        new_kv = [torch.randn(batch, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        self.step_kv = (new_kv[0], new_kv[1], slots)
        self.bound = bound

    def launches(self, splits: int | None) -> list[Callable[[], object]]:
        """One decode attention launch a layer, as the engine's graph holds them."""
        return [lambda layer=layer: self._launch(layer, splits) for layer in range(LAYERS)]

    def _launch(self, layer: int, splits: int | None) -> None:
        paged_decode(
            self.queries[layer], self.caches[layer % CACHES], self.block_tables, self.seq_lens, DIM**-0.5,
            out=self.outs[layer], step_kv=self.step_kv, max_seq_len=self.bound, num_splits=splits,
            kv_scale=self.scales[layer % CACHES],
        )  # fmt: skip

    def error(self) -> float:
        """Largest difference of the last layer's output from the torch twin's."""
        layer = LAYERS - 1
        starts = torch.arange(len(self.seq_lens) + 1, device="cuda", dtype=torch.int32)
        cache, scale = self.caches[layer % CACHES], self.scales[layer % CACHES]
        if scale is not None:  # the 8-bit rows widened (the step's own row is compared as stored)
            cache = dequantize_kv(cache, scale.transpose(2, 3)).to(torch.bfloat16)
        expected = reference.paged_attention(
            self.queries[layer],
            cache,
            self.block_tables,
            starts,
            self.seq_lens,
            DIM**-0.5,
        )
        return max_abs_err(expected, self.outs[layer])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[768, 8192])
    parser.add_argument("--splits", type=int, nargs="*", default=[12, 16, 32, 64])
    parser.add_argument("--bound", type=int, default=8192, help="context bound of the decode graphs")
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=CACHE_DTYPES, default=["bf16"])
    args = parser.parse_args()
    print(
        "cache | batch | context | " + " | ".join(["auto"] + [str(s) for s in args.splits]) + " | max error"
    )
    for name in args.kv_cache_dtype:
        for batch in args.batch:
            for context in args.context:
                row = measure(DecodeStep(batch, context, args.bound, CACHE_DTYPES[name]), args.splits)
                print(f"{name} | {batch} | {context} | {row}", flush=True)
                torch.cuda.empty_cache()


def measure(step: DecodeStep, forced_splits: list[int]) -> str:
    """The row's cells: us a launch at the automatic split count and at each forced one, max error."""
    batch = len(step.seq_lens)
    block_n, _ = launch_tile(batch, KV_HEADS, step.scales[0] is not None, decode_step=True, block_n=None)
    auto = choose_splits(batch, KV_HEADS, step.bound, block_n)
    cells = [f"{graph_us(step.launches(None), REPLAYS):.2f} ({auto})"]
    errors = [step.error()]
    for splits in forced_splits:
        cells.append(f"{graph_us(step.launches(splits), REPLAYS):.2f}")
        errors.append(step.error())
    return " | ".join(cells) + f" | {max(errors):.1e}"


if __name__ == "__main__":
    main()
