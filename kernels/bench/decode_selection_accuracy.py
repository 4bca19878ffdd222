"""Selective decode's error against dense decode on planted attention, by budget (issue 34: the
default budget is chosen by measurement, and never on one input family).

Families of planted structure (`decode_synthetic.FAMILIES`: `sparse/synthetic.py`'s, seen by the
last query, plus a needle only it seeks), each at several contexts, needle depths and seeds: the
largest relative L2 of selective decode's output against dense float32 attention, beside choosing
every block by its true largest logit (the oracle the selection approximates) and beside attending
over the sink and the recent window alone (StreamingLLM) at the same budget. Runs the kernels on CUDA,
their twins elsewhere.

    python kernels/bench/decode_selection_accuracy.py [--contexts 32768 131072] [--budgets ...]
"""

from __future__ import annotations

import argparse

import torch

from tgserve.kernels.decode_selection import DecodeSelection
from tgserve.kernels.decode_synthetic import FAMILIES, planted_decode, selection_error
from tgserve.kernels.sparse.synthetic import Planted


def worst_errors(n: int, plant: Planted, budget: int, device: str) -> tuple[float, float, float]:
    """The largest error over needle depths and seeds: selected, oracle, streaming."""
    selection = DecodeSelection.for_budget(budget, 0)
    streaming = DecodeSelection(budget, 0, sink=64, recent=budget - 64 - 16)
    errors = []
    for depth in (0.05, 0.5, 0.95):
        for seed in (0, 1):
            inputs = planted_decode(n, 8, 2, 64, seed=seed + int(depth * 100), depth=depth, plant=plant,
                                    device=device)  # fmt: skip
            errors.append((selection_error(inputs, selection, 16), selection_error(inputs, selection, 16, oracle=True),
                           selection_error(inputs, streaming, 16)))  # fmt: skip
    return tuple(max(e[i] for e in errors) for i in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        "Each cell: selected (the best bounds, rescored exactly) / oracle (every block by its true largest "
        "logit) / sink and recent alone\n"
    )
    print("| family | context | " + " | ".join(f"budget {b}" for b in args.budgets) + " |")
    print("|---|---|" + "---|" * len(args.budgets))
    for name, plant in FAMILIES.items():
        for n in args.contexts:
            cells = [worst_errors(n, plant, budget, device) for budget in args.budgets]
            row = " | ".join(f"{s:.1e} / {o:.1e} / {r:.2f}" for s, o, r in cells)
            print(f"| {name} | {n:,} | {row} |", flush=True)


if __name__ == "__main__":
    main()
