"""The skinny linear kernel against cuBLAS (F.linear) on Llama-3-8B's projections, in CUDA graphs.

    python kernels/bench/bench_gemv.py

Batch-1 decode runs each projection once per layer inside a CUDA graph, its weight read from HBM
(the 8B model's 16 GB cannot stay in the 50 MB L2). So each measurement captures one graph that
runs the product over enough copies of the weight to exceed L2 (400 MB), and reports the graph's
time per product. Rows 1 and 2, bf16; shapes of one GPU and of two-way tensor parallelism; each
kernel setting of the sweep checked against cuBLAS's output. `dispatch.SKINNY_MAX_ROWS` is set
from this table.

    python kernels/bench/bench_gemv.py --fp8

The same for fp8 weights with a scale per row (`--quantize fp8`): the skinny kernel against cuBLAS's
fp8 product of quantized rows (`torch._scaled_mm`, quantization included) and the bf16 cuBLAS
product, at 1 to 16 rows. `gemv.CONFIG_FP8` and `fp8.SKINNY_MAX_ROWS` are set from this table.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tgserve.kernels.fp8 import quantize_rows
from tgserve.kernels.gemv import skinny_linear

SHAPES = {  # name: (N, K) of the weight
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "o_proj tp2": (4096, 2048),
    "qkv tp2": (3072, 4096),
}
SWEEP = [
    dict(BLOCK_N=n, BLOCK_K=k, num_warps=w)
    for n, k, w in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8))
]


def graph_us(products: list[Callable[[], object]], replays: int = 10) -> float:
    """Microseconds per product of a CUDA graph that runs them all once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate before capture
        for product in products:
            product()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for product in products:
            product()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / len(products)


def measure(rows: int, n: int, k: int) -> tuple[float, float, dict, float]:
    """(cuBLAS us, best skinny us, its setting, its max error relative to cuBLAS's largest output)."""
    copies = max(2, -(-(400 << 20) // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, weights[0]).float()
    cublas = graph_us([lambda w=w: F.linear(x, w) for w in weights])
    best = None
    for config in SWEEP:
        err = float(
            (skinny_linear(x, weights[0], None, config).float() - want).abs().max() / want.abs().max()
        )
        us = graph_us([lambda w=w, c=config: skinny_linear(x, w, None, c) for w in weights])
        if best is None or us < best[0]:
            best = (us, config, err)
    return cublas, *best


FP8_SWEEP = [dict(BLOCK_N=4, BLOCK_K=512, num_warps=4)] + [
    dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for n, k, w in itertools.product((4, 8), (1024, 2048), (4, 8))
]


def measure_fp8(rows: int, n: int, k: int) -> tuple[float, float, float, dict, float]:
    """(bf16 cuBLAS us, fp8 cuBLAS us, best fp8 skinny us, its setting, its max error relative to
    the dequantized weight's bf16 product)."""
    copies = max(2, -(-(400 << 20) // (n * k)))
    full = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    weights = [quantize_rows(w) for w in full]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w_q, scale = weights[0]
    want = F.linear(x.float(), w_q.float() * scale)
    bf16 = graph_us([lambda w=w: F.linear(x, w) for w in full[: max(2, copies // 2)]])
    del full
    cublas = graph_us([lambda w=w: _scaled_product(x, *w) for w in weights])
    best = None
    for config in FP8_SWEEP:
        got = skinny_linear(x, w_q, None, config, weight_scale=scale).float()
        err = float((got - want).abs().max() / want.abs().max())
        us = graph_us(
            [lambda w=w, c=config: skinny_linear(x, w[0], None, c, weight_scale=w[1]) for w in weights]
        )
        if best is None or us < best[0]:
            best = (us, config, err)
    return bf16, cublas, *best


def _scaled_product(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS's fp8 product however many rows (fp8_linear takes the skinny kernel at a few)."""
    from tgserve.kernels.fp8_rows import quantize_rows_triton

    x_q, x_scale = quantize_rows_triton(x)
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=torch.bfloat16)


def main_fp8() -> None:
    print("| weight | rows | bf16 cuBLAS us | fp8 cuBLAS us | fp8 skinny us | setting | rel. error |")
    print("|---|---|---|---|---|---|---|")
    for rows in (1, 8, 16):
        for name, (n, k) in list(SHAPES.items())[:4]:
            bf16, cublas, us, config, err = measure_fp8(rows, n, k)
            print(f"| {name} {n}x{k} | {rows} | {bf16:.2f} | {cublas:.2f} | {us:.2f} | {config} | {err:.1e} |",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fp8", action="store_true", help="fp8 weights (--quantize fp8)")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if parser.parse_args().fp8:
        main_fp8()
        return
    print("| weight | rows | cuBLAS us | skinny us | setting | rel. error |\n|---|---|---|---|---|---|")
    for rows in (1, 2):
        for name, (n, k) in SHAPES.items():
            cublas, us, config, err = measure(rows, n, k)
            print(f"| {name} {n}x{k} | {rows} | {cublas:.2f} | {us:.2f} | {config} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
