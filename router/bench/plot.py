"""One PNG comparing runs: throughput and latency percentiles against the concurrency cap."""

from __future__ import annotations

from typing import Any


def plot_runs(runs: list[dict[str, Any]], path: str, title: str) -> bool:
    """Write the plot; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        ("output_throughput", None, "output tokens / s"),
        ("ttft_ms", "median", "TTFT median (ms)"),
        ("tpot_ms", "median", "TPOT median (ms)"),
        ("e2el_ms", "p99", "end-to-end latency p99 (ms)"),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (key, stat, label) in zip(axes.flat, panels):
        for mode in sorted({run["mode"] for run in runs}):
            selected = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["max_concurrency"])
            xs = [r["max_concurrency"] for r in selected]
            ys = [r["summary"][key][stat] if stat else r["summary"][key] for r in selected]
            axis.plot(xs, ys, marker="o", label=mode)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("max concurrency")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
