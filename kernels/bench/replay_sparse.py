"""Replay the sparse indices of a real prefill through the kernel: whole layers, and by part.

    python benchmarks/engine_cuda.py --only long --save-sparse-index /tmp/idx   # record (c)'s indices
    python kernels/bench/replay_sparse.py /tmp/idx                               # replay them

Random q/k/v (32 query / 8 KV heads, head_dim 128, bf16) in the engine's fused-QKV layout, so a
kernel change is timed on the pattern the engine produced without running the model. Prints the
median ms of each recorded layer, then, for one layer, the diagonals alone and the diagonals with
the listed blocks (the rest is the columns), with TFLOP/s over the tiles each computes.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tgserve.kernels.sparse import kernel
from tgserve.kernels.sparse.index import SparseIndex

HEADS, KV_HEADS, DIM = 32, 8, 128


def save_index(index: SparseIndex, path: Path) -> None:
    fields = {f.name: getattr(index, f.name) for f in dataclasses.fields(index)}
    torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in fields.items()}, path)


def load_index(path: Path, device: str = "cuda") -> SparseIndex:
    """A saved index; fields SparseIndex no longer has (older recordings) are dropped."""
    saved = torch.load(path)
    names = {f.name for f in dataclasses.fields(SparseIndex)}
    return SparseIndex(
        **{k: v.to(device) if torch.is_tensor(v) else v for k, v in saved.items() if k in names}
    )


@contextmanager
def recording(folder: Path, layers: tuple[int, ...] = (0, 16, 30)) -> Iterator[None]:
    """Save the index of the given layers of the first sparse prefill run inside the block (by call:
    a model's last layer attends only its logit rows, without an index; 30 is Llama-3-8B's last
    sparse layer)."""
    folder.mkdir(parents=True, exist_ok=True)
    original = kernel.sparse_attention_kernel
    calls = [0]

    def saving(query, key, value, index, scale, out=None):
        if calls[0] in layers:
            save_index(index, folder / f"index-L{calls[0]}.pt")
        calls[0] += 1
        return original(query, key, value, index, scale, out=out)

    kernel.sparse_attention_kernel = saving  # the attention module looks it up at each call
    try:
        yield
    finally:
        kernel.sparse_attention_kernel = original


def replay(folder: Path, iters: int) -> None:
    from bench_attention import timed_ms  # this script's folder is on sys.path when run as a script

    paths = sorted(folder.glob("index-L*.pt"), key=lambda p: int(p.stem.split("L")[-1]))
    indices = {p.stem: load_index(p) for p in paths}
    n = next(iter(indices.values())).seq_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(n, HEADS + 2 * KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]

    def row(name: str, index: SparseIndex) -> None:
        ms = timed_ms(
            lambda: kernel.sparse_attention_kernel(q, k, v, index, DIM**-0.5), warmup=1, iters=iters
        )
        tiles = index.tiles()
        tflops = tiles * 4 * index.block**2 * DIM / ms / 1e9
        print(f"{name:<28} {ms:8.2f} ms  {tiles / 1e6:6.2f} M tiles  {tflops:5.0f} TFLOP/s", flush=True)

    for name, index in indices.items():
        row(name, index)
    last = list(indices.values())[len(indices) // 2]
    no_columns = dataclasses.replace(last, column_count=torch.zeros_like(last.column_count))
    row("  diagonals + listed blocks", no_columns)
    row("  diagonals", dataclasses.replace(no_columns, block_count=torch.zeros_like(last.block_count)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="index-L<layer>.pt files from --save-sparse-index")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    print(f"launch {kernel.LAUNCH}")
    replay(args.folder, args.iters)


if __name__ == "__main__":
    main()
