"""Attention benchmarks for one H200 (or any CUDA GPU): dense prefill, sparse prefill, paged kernels.

    python kernels/bench/bench_attention.py --out docs/benchmarks

Shapes: batch 1, 32 query heads, 8 KV heads, head_dim 128, bf16, causal.
  dense prefill   SDPA cuDNN backend, SDPA flash backend, FlexAttention (causal block mask),
                  flash-attn varlen if installed, tgserve's Triton varlen kernel, and tgserve's
                  dense dispatch (what fresh_prefill runs below the sparse threshold);
                  --cudnn lengths: the cuDNN baseline alone (1 timed run past 128K)
  sparse prefill  default pattern config (vertical-slash 1000/6096, rescue 2) on planted prompts:
                  estimation, sparse kernel and total, against cuDNN dense (the issue's
                  baseline), with the kernel's TFLOP/s on the tiles it computes
  kernel only     --kernel-only lengths (1M): sparse kernel time and memory, index estimated once
  paged decode    batch 64 x 4K context: time and achieved HBM bandwidth (KV bytes read / time)
  paged prefill   chunked prefill: 4 chunks of 2K queries over 8K contexts
Writes bench_attention.json and bench_attention.md under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 32, 8, 128
DTYPE = torch.bfloat16


def timed_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of fn() over iters runs, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def causal_tflops(n: int, ms: float) -> float:
    """Useful FLOPs of causal attention (QK^T and PV, half the matrix) per second, in TFLOP/s."""
    return 4 * n * n * DIM * HEADS / 2 / (ms * 1e-3) / 1e12


def try_ms(fn: Callable[[], object], iters: int) -> float | None:
    """Time fn, or None when the backend refuses the shape (e.g. cuDNN without GQA support)."""
    try:
        return timed_ms(fn, iters=iters)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        print(f"    skipped: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        return None


def sdpa_backend(backend) -> Callable:
    """SDPA pinned to one backend, GQA without repeating KV."""
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


def dense_prefill_rows(n: int, iters: int) -> dict[str, float | None]:
    """Milliseconds of each dense causal prefill implementation at length n."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from tgserve.kernels import dispatch
    from tgserve.kernels.paged_prefill import varlen_prefill

    q = torch.randn(1, HEADS, n, DIM, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(1, KV_HEADS, n, DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    rows: dict[str, float | None] = {}
    rows["sdpa_cudnn"] = try_ms(lambda: sdpa_backend(SDPBackend.CUDNN_ATTENTION)(q, k, v), iters)
    rows["sdpa_flash"] = try_ms(lambda: sdpa_backend(SDPBackend.FLASH_ATTENTION)(q, k, v), iters)
    # _compile avoids materialising the n x n mask (128 GiB at 128K) to find the blocks.
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, n, n, device="cuda", _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    rows["flex_block_mask"] = try_ms(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True), iters)
    qf, kf, vf = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    rows["triton_varlen"] = try_ms(lambda: varlen_prefill(qf, kf, vf, cu, DIM**-0.5), iters)
    rows["tgserve_dispatch"] = try_ms(lambda: dispatch.dense_prefill(qf, kf, vf, cu, n, DIM**-0.5), iters)
    try:
        from flash_attn import flash_attn_varlen_func

        rows["flash_attn_varlen"] = try_ms(
            lambda: flash_attn_varlen_func(qf, kf, vf, cu, cu, n, n, causal=True), iters
        )
    except ImportError:
        pass
    return rows


def cudnn_row(n: int) -> dict[str, float | None]:
    """The cuDNN dense baseline alone (for lengths where the other backends take seconds)."""
    from torch.nn.attention import SDPBackend

    q = torch.randn(1, HEADS, n, DIM, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(1, KV_HEADS, n, DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    run = sdpa_backend(SDPBackend.CUDNN_ATTENTION)
    try:
        ms = timed_ms(lambda: run(q, k, v), warmup=1, iters=1 if n > 131072 else 3)
    except RuntimeError as err:
        print(f"    skipped: {str(err).splitlines()[0][:120]}")
        ms = None
    return {"sdpa_cudnn": ms}


def _sparse_setup(n: int, pattern: dict | None = None):
    from tgserve.kernels.sparse.attention import estimate_index
    from tgserve.kernels.sparse.config import SparseConfig, parse_sparse_config
    from tgserve.kernels.sparse.synthetic import planted_prompt
    from tgserve.kernels.sparse.tail_kernel import skipped_tail_triton

    config = parse_sparse_config({"default": pattern}) if pattern else SparseConfig()
    patterns = config.head_patterns(0, HEADS, seq_len=n)
    p = planted_prompt(n, HEADS, KV_HEADS, DIM, seed=0, dtype=DTYPE, device="cuda")

    def estimate():
        """The index, and with tail patterns the tail too (`sparse/tail.py`), as sparse_prefill runs them."""
        index = estimate_index(
            p.query, p.key, p.scale, patterns, config.block, config.last_q, use_triton=True
        )
        if not any(x.tail for x in patterns):
            return index, None
        return index, skipped_tail_triton(p.query, p.key, p.value, index, p.scale, [x.tail for x in patterns])

    return p, estimate


def tile_tflops(index, ms: float) -> float:
    """TFLOP/s of the sparse kernel counting every block x block tile it computes (QK^T and PV)."""
    return index.tiles() * 4 * index.block**2 * DIM / (ms * 1e-3) / 1e12


def sparse_prefill_row(n: int, iters: int, pattern: dict | None = None) -> dict[str, float]:
    """Estimation, kernel and total milliseconds of the sparse config (default, or every head on
    `pattern`'s fields), density, tile TFLOP/s."""
    from tgserve.kernels.sparse.kernel import sparse_attention_kernel

    p, estimate = _sparse_setup(n, pattern)
    index, tail = estimate()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    est = timed_ms(estimate, warmup=1, iters=iters)
    est_mem = torch.cuda.max_memory_allocated() - base
    kern = timed_ms(
        lambda: sparse_attention_kernel(p.query, p.key, p.value, index, p.scale, tail=tail),
        warmup=1,
        iters=iters,
    )
    return {"estimate_ms": est, "kernel_ms": kern, "total_ms": est + kern, "density": index.density(),
            "tiles": index.tiles(), "kernel_TFLOP/s": tile_tflops(index, kern),
            "estimate_peak_GiB": est_mem / 2**30}  # fmt: skip


def kernel_only_row(n: int) -> dict[str, float]:
    """Sparse kernel alone at n tokens (index estimated once, untimed): time, TFLOP/s, memory."""
    from tgserve.kernels.sparse.kernel import sparse_attention_kernel

    p, estimate = _sparse_setup(n)
    index, _ = estimate()
    out = torch.empty_like(p.query)
    torch.cuda.synchronize()
    tensors = [p.query, p.key, p.value, out] + [x for x in vars(index).values() if torch.is_tensor(x)]
    held = sum(x.numel() * x.element_size() for x in tensors)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = timed_ms(lambda: sparse_attention_kernel(p.query, p.key, p.value, index, p.scale, out=out),
                  warmup=1, iters=2)  # fmt: skip
    return {"kernel_ms": ms, "density": index.density(), "kernel_TFLOP/s": tile_tflops(index, ms),
            "inputs_output_index_GiB": held / 2**30,
            "kernel_extra_GiB": (torch.cuda.max_memory_allocated() - base) / 2**30}  # fmt: skip


def paged_decode_row(batch: int = 64, context: int = 4096, block_size: int = 16) -> dict[str, float]:
    """Decode over a paged cache: time and HBM bandwidth (keys + values + queries + outputs)."""
    from tgserve.kernels.paged_decode import paged_decode

    blocks = batch * context // block_size
    cache = torch.randn(2, blocks, block_size, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
    tables = torch.randperm(blocks, device="cuda").view(batch, -1).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    ms = timed_ms(
        lambda: paged_decode(q, cache, tables, seq_lens, DIM**-0.5, out=out, max_seq_len=context), iters=50
    )
    moved = cache.numel() * cache.element_size() + 2 * q.numel() * q.element_size() + tables.numel() * 4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(q, cache, tables, seq_lens, DIM**-0.5, out=out, max_seq_len=context)
    graph_ms = timed_ms(graph.replay, iters=50)
    return {
        "ms": ms,
        "graph_ms": graph_ms,
        "GB/s": moved / (ms * 1e-3) / 1e9,
        "graph_GB/s": moved / (graph_ms * 1e-3) / 1e9,
    }


def paged_prefill_row(
    chunks: int = 4, chunk: int = 2048, context: int = 8192, block_size: int = 16
) -> dict[str, float]:
    """Chunked prefill: each sequence's last `chunk` queries over a `context`-token paged cache."""
    from tgserve.kernels.paged_prefill import paged_prefill

    per_seq = context // block_size
    cache = torch.randn(2, chunks * per_seq, block_size, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
    tables = torch.randperm(chunks * per_seq, device="cuda").view(chunks, -1).to(torch.int32)
    q = torch.randn(chunks * chunk, HEADS, DIM, device="cuda", dtype=DTYPE)
    starts = torch.arange(chunks + 1, device="cuda", dtype=torch.int32) * chunk
    seq_lens = torch.full((chunks,), context, dtype=torch.int32, device="cuda")
    ms = timed_ms(lambda: paged_prefill(q, cache, tables, starts, seq_lens, DIM**-0.5), iters=20)
    # Each query sees context - chunk earlier keys plus a causal triangle of its chunk.
    pairs = chunks * (chunk * (context - chunk) + chunk * chunk / 2)
    return {"ms": ms, "TFLOP/s": 4 * pairs * DIM * HEADS / (ms * 1e-3) / 1e12}


def markdown(results: dict) -> str:
    """Human-readable tables of the results."""
    lines = [f"# Attention benchmarks ({results['device']})", "",
             f"Batch 1, {HEADS} query heads, {KV_HEADS} KV heads, head_dim {DIM}, bf16, causal.", "",
             "## Dense prefill (ms, TFLOP/s)", ""]  # fmt: skip
    names = sorted({name for row in results["dense"].values() for name in row})
    lines += ["| tokens | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for n, row in results["dense"].items():
        cells = [
            f"{row[x]:.2f} ({causal_tflops(int(n), row[x]):.0f})" if row.get(x) else "n/a" for x in names
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    dense_at = {n: row.get("sdpa_cudnn") for n, row in {**results["dense"], **results["cudnn"]}.items()}
    lines += ["", "## Sparse prefill, default config (ms; speed-up = cuDNN dense / sparse total)", "",
              "| tokens | estimate | kernel | total | density | kernel TFLOP/s (tiles) | cuDNN dense | speed-up |",
              "|---" * 8 + "|"]  # fmt: skip
    for n, row in results["sparse"].items():
        dense = dense_at.get(n)
        speed = f"{dense / row['total_ms']:.2f}x" if dense else "n/a"
        lines.append(f"| {n} | {row['estimate_ms']:.1f} | {row['kernel_ms']:.1f} | {row['total_ms']:.1f} | "
                     f"{row['density']:.3f} | {row['kernel_TFLOP/s']:.0f} | {dense or float('nan'):.1f} | "
                     f"{speed} |")  # fmt: skip
    for n, row in results["kernel_only"].items():
        lines += ["", f"Kernel only at {n} tokens: {row['kernel_ms']:.1f} ms, density {row['density']:.4f}, "
                  f"{row['kernel_TFLOP/s']:.0f} TFLOP/s on its tiles; memory: q, k, v, out and index "
                  f"{row['inputs_output_index_GiB']:.2f} GiB; allocated by the kernel call beyond them: "
                  f"{row['kernel_extra_GiB']:.3f} GiB."]  # fmt: skip
    d, p = results["decode"], results["prefill_paged"]
    lines += ["", "## Paged kernels", "",
              f"- decode, batch 64 x 4K: {d['ms']:.3f} ms eager ({d['GB/s']:.0f} GB/s), "
              f"{d['graph_ms']:.3f} ms in a CUDA graph ({d['graph_GB/s']:.0f} GB/s); H200 peak ~4800 GB/s",
              f"- chunked prefill, 4 x 2K queries over 8K contexts: {p['ms']:.2f} ms ({p['TFLOP/s']:.0f} TFLOP/s)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--dense", type=int, nargs="*", default=[4096, 16384, 32768, 131072, 524288])
    parser.add_argument("--sparse", type=int, nargs="*", default=[32768, 131072, 524288])
    parser.add_argument("--cudnn", type=int, nargs="*", default=[], help="cuDNN-only baseline lengths")
    parser.add_argument("--kernel-only", type=int, nargs="*", default=[1048576])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--pattern", type=json.loads, default=None,
                        help='sparse rows: every head on these HeadPattern fields, e.g. \'{"vertical": 512}\'')  # fmt: skip
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    results: dict = {"device": torch.cuda.get_device_name(), "dense": {}, "cudnn": {}, "sparse": {},
                     "kernel_only": {}}  # fmt: skip
    for n in args.dense:
        print(f"dense {n}")
        results["dense"][str(n)] = dense_prefill_rows(n, args.iters if n <= 131072 else 2)
        print("   ", results["dense"][str(n)])
    for n in args.cudnn:
        print(f"cudnn {n}")
        results["cudnn"][str(n)] = cudnn_row(n)
        print("   ", results["cudnn"][str(n)])
    for n in args.sparse:
        print(f"sparse {n}")
        results["sparse"][str(n)] = sparse_prefill_row(n, args.iters if n <= 131072 else 2, args.pattern)
        print("   ", results["sparse"][str(n)])
        torch.cuda.empty_cache()
    for n in args.kernel_only:
        print(f"kernel only {n}")
        results["kernel_only"][str(n)] = kernel_only_row(n)
        print("   ", results["kernel_only"][str(n)])
        torch.cuda.empty_cache()
    results["decode"] = paged_decode_row()
    results["prefill_paged"] = paged_prefill_row()
    print(results["decode"], results["prefill_paged"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_attention.json").write_text(json.dumps(results, indent=2))
    (args.out / "bench_attention.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
