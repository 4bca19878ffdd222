"""The skinny linear kernel against cuBLAS (F.linear) on Llama-3-8B's projections, in CUDA graphs.

    python kernels/bench/bench_gemv.py

Batch-1 decode runs each projection once per layer inside a CUDA graph, its weight read from HBM
(the 8B model's 16 GB cannot stay in the 50 MB L2). So each measurement captures one graph that
runs the product over enough copies of the weight to exceed L2 (400 MB), and reports the graph's
time per product. Rows 1 and 2, bf16; shapes of one GPU and of two-way tensor parallelism; each
kernel setting of the sweep checked against cuBLAS's output. `gemv_settings.SKINNY_MAX_ROWS`, the
rule for devices the tuned table does not hold, was set from this table on an H200.

    python kernels/bench/bench_gemv.py --tune --write kernels/gemv_tuned.json

One row through each projection shape of the served families (benchmarks/families_cuda.py's, and
Llama-3-8B's under two-way tensor parallelism): cuBLAS, the skinny kernel's default setting and the
fastest of the sweep; --write records, under this device's name, the fastest setting of each shape
or "cublas" where cuBLAS is at least as fast (within 1%), which `dispatch.linear` then follows.

    python kernels/bench/bench_gemv.py --fp8

fp8 weights with a scale per row (`--quantize fp8`): kernels/fp8_gemv.py against cuBLAS's fp8
product (`torch._scaled_mm`) and the bf16 cuBLAS product, at 1 to 16 rows, the rows' quantization
included in both fp8 columns. `fp8_gemv.launch_config` and `fp8_format.GEMV_MAX_ROWS` are set from this
table; its error column is the float32 output's, where the MMA's own summation shows.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from tgserve.kernels.fp8_format import quantize_rows
from tgserve.kernels.gemv import skinny_linear

SHAPES = {  # name: (N, K) of the weight
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "o_proj tp2": (4096, 2048),
    "qkv tp2": (3072, 4096),
    "phi-3 o_proj": (3072, 3072),
    "phi-3 down": (3072, 8192),
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
    cublas, timed = measure_each(rows, n, k, SWEEP)
    us, err, best = fastest(timed)
    return cublas, us, SWEEP[best], err


def fastest(timed: list[tuple[float, float]]) -> tuple[float, float, int]:
    """(us, error, index) of the fastest of measure_each's settings."""
    return min((us, err, i) for i, (us, err) in enumerate(timed))


def measure_each(
    rows: int, n: int, k: int, candidates: list[dict]
) -> tuple[float, list[tuple[float, float]]]:
    """cuBLAS us, and (us, max error relative to cuBLAS's largest output) for each skinny setting."""
    copies = max(2, -(-(400 << 20) // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, weights[0]).float()
    cublas = graph_us([lambda w=w: F.linear(x, w) for w in weights])
    timed = []
    for config in candidates:
        err = float(
            (skinny_linear(x, weights[0], None, config).float() - want).abs().max() / want.abs().max()
        )
        timed.append((graph_us([lambda w=w, c=config: skinny_linear(x, w, None, c) for w in weights]), err))
    return cublas, timed


# Output rows x input width of each one-row product at batch-1 decode (fused qkv and gate_up where
# the family fuses them; the transformers fallback's separate projections for OLMo 2 and Granite).
TUNE_SHAPES = {
    "qwen3-30b-a3b": [(5120, 2048), (2048, 4096), (128, 2048)],
    "phi-3-mini": [(9216, 3072), (3072, 3072), (16384, 3072), (3072, 8192)],
    "llama-3-8b / qwen3-8b / mixtral": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "qwen3-8b": [(24576, 4096), (4096, 12288)],
    "mixtral-8x7b router": [(8, 4096)],
    "gemma-2-9b": [(8192, 3584), (3584, 4096), (28672, 3584), (3584, 14336)],
    "gpt-oss-20b": [(5120, 2880), (2880, 4096), (32, 2880)],
    "olmo2-7b (fallback)": [(11008, 4096), (4096, 11008)],
    "granite-3-8b (fallback)": [(1024, 4096), (12800, 4096), (4096, 12800)],
    "llama-3-8b, two-way TP": [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)],
}
TUNE_SWEEP = SWEEP + [
    dict(BLOCK_N=1, BLOCK_K=k, num_warps=w) for k, w in itertools.product((512, 1024), (4, 8))
]
CUBLAS_MARGIN = 0.99  # a tuned setting must beat cuBLAS by 1% to be recorded: closer is noise


def tune(write: Path | None) -> None:
    """Each shape once: cuBLAS, the default setting, the fastest of TUNE_SWEEP; the choice recorded."""
    from tgserve.kernels.gemv import CONFIG
    from tgserve.kernels.gemv_settings import CUBLAS, shape_key

    shapes = list(dict.fromkeys(shape for group in TUNE_SHAPES.values() for shape in group))
    candidates = [CONFIG, *TUNE_SWEEP]  # the default first
    print("| weight | cuBLAS us | skinny default us | skinny tuned us | setting | TB/s | chosen |\n"
          "|---|---|---|---|---|---|---|")  # fmt: skip
    chosen: dict[str, dict | str] = {}
    for n, k in shapes:
        cublas, timed = measure_each(1, n, k, candidates)
        default = timed[0][0]
        us, _, best = fastest(timed)
        config = candidates[best]
        pick = config if us < CUBLAS_MARGIN * cublas else CUBLAS
        chosen[shape_key(n, k)] = pick
        print(f"| {n}x{k} | {cublas:.2f} | {default:.2f} | {us:.2f} | {config} | {n * k * 2 / min(us, cublas) / 1e6:.2f} | "
              f"{'cuBLAS' if pick == CUBLAS else 'skinny'} |", flush=True)  # fmt: skip
        if write is not None:  # after each shape: a run cut short keeps what it measured
            record(write, chosen)


def record(path: Path, chosen: dict[str, dict | str]) -> None:
    """This device's choices into the table at path, other devices' kept."""
    table = json.loads(path.read_text()) if path.exists() else {}
    table[torch.cuda.get_device_name()] = {
        "measured": f"{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}",
        "shapes": chosen,
    }
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


GEMV_SWEEP = [
    dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, IMPRECISE_ACC=a)
    for n, k, w, s, a in itertools.product((32, 64, 128), (128, 256, 512), (4, 8), (3, 4, 5), (32, 128))
    if (n + 16) * k * s <= 200 << 10 and not (w == 8 and n == 32)  # what fits in shared memory
]


def _best(candidates: list[dict], product: Callable, weights: list, want: torch.Tensor, exact=None) -> tuple:
    """(us, setting, max error relative to want's largest) of the fastest setting; `exact(weight,
    setting)`, where given, is the output whose error is measured (a float32 one)."""
    best = None
    for config in candidates:
        try:
            got = (exact or product)(weights[0], config).float()
        except Exception as error:  # a setting that does not fit (shared memory): skip it
            print(f"skipped {config}: {type(error).__name__}", flush=True)
            continue
        err = float((got - want).abs().max() / want.abs().max())
        us = graph_us([lambda w=w, c=config: product(w, c) for w in weights])
        if best is None or us < best[0]:
            best = (us, config, err)
    return best


def measure_fp8(rows: int, n: int, k: int) -> tuple:
    """(bf16 cuBLAS us, fp8 cuBLAS us, best fp8 GEMV (us, setting, float32 output's max error relative
    to the dequantized operands' largest product)."""
    from tgserve.kernels.fp8_gemv import fp8_gemv
    from tgserve.kernels.fp8_rows import quantize_rows_triton

    copies = max(2, -(-(400 << 20) // (n * k)))
    full = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    weights = [quantize_rows(w) for w in full]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w_q, scale = weights[0]
    bf16 = graph_us([lambda w=w: F.linear(x, w) for w in full[: max(2, copies // 2)]])
    del full
    cublas = graph_us([lambda w=w: _scaled_product(x, *w) for w in weights])
    x_q, x_scale = quantize_rows(x)
    want = ((x_q.double() @ w_q.double().t()) * x_scale.double() * scale.double().t()).float()
    gemv = _best(GEMV_SWEEP, lambda w, c: fp8_gemv(*quantize_rows_triton(x), *w, config=c), weights, want,
                 exact=lambda w, c: fp8_gemv(x_q, x_scale, *w, out_dtype=torch.float32, config=c))  # fmt: skip
    return bf16, cublas, gemv


def _scaled_product(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS's fp8 product however many rows (fp8_linear takes the skinny kernel at a few)."""
    from tgserve.kernels.fp8_rows import quantize_rows_triton

    x_q, x_scale = quantize_rows_triton(x)
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=torch.bfloat16)


def main_fp8() -> None:
    print("| weight | rows | bf16 cuBLAS us | fp8 cuBLAS us | fp8 GEMV us | GEMV TB/s | GEMV setting | "
          "GEMV float32 rel. error |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for rows in (1, 2, 4, 8, 16):
        for name, (n, k) in list(SHAPES.items())[:4]:
            bf16, cublas, (us, config, err) = measure_fp8(rows, n, k)
            print(f"| {name} {n}x{k} | {rows} | {bf16:.2f} | {cublas:.2f} | {us:.2f} | "
                  f"{n * k / us / 1e6:.2f} | {config} | {err:.1e} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fp8", action="store_true", help="fp8 weights (--quantize fp8)")
    parser.add_argument("--tune", action="store_true", help="the served families' shapes, one row")
    parser.add_argument("--write", type=Path, help="with --tune: record the choices in this JSON file")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.tune:
        tune(args.write)
        return
    if args.fp8:
        main_fp8()
        return
    print("| weight | rows | cuBLAS us | skinny us | setting | rel. error |\n|---|---|---|---|---|---|")
    for rows in (1, 2):
        for name, (n, k) in SHAPES.items():
            cublas, us, config, err = measure(rows, n, k)
            print(f"| {name} {n}x{k} | {rows} | {cublas:.2f} | {us:.2f} | {config} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
