"""GPU benchmark (issue 36): where should sparse prefill start? One prompt's prefill with the
default threshold (the whole prompt in one step, sparse attention) against chunked dense prefill
(threshold out of reach), the engine's alternative below it. Llama-3-8B's shape, 32 layers, dummy
weights, batch 1; each length's best of two runs after one warm-up. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from engine_cuda import prompts, run_engine, write_model_dir  # noqa: E402

from tgserve.server.config.engine_args import EngineArgs  # noqa: E402
from tgserve.server.engine.llm_engine import LLMEngine  # noqa: E402

MODES = {"whole-prompt sparse": None, "chunked dense": 1 << 30}  # sparse_min_seq_len


def prefill_seconds(engine: LLMEngine, length: int, runs: int = 3) -> float:
    times = [
        run_engine(engine, prompts(1, length, engine.vocab_size, seed=s), 1)["prefill_s"] for s in range(runs)
    ]
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[32640, 49024, 65408])
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    rows: dict[int, dict[str, float]] = {n: {} for n in args.lengths}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), args.layers)
        for mode, threshold in MODES.items():
            engine = LLMEngine(
                EngineArgs(
                    model=str(model_dir), load_format="dummy", max_num_seqs=1, max_model_len=max(args.lengths) + 16,
                    cuda_graphs=False, enable_prefix_caching=False, gpu_memory_utilization=0.4,
                    sparse_min_seq_len=threshold,
                )
            )  # fmt: skip
            for n in args.lengths:
                rows[n][mode] = prefill_seconds(engine, n)
                print(f"{n} {mode}: {rows[n][mode]:.3f} s", flush=True)
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    print("| prompt tokens | " + " | ".join(f"{m} s" for m in MODES) + " |")
    print("|---" * (len(MODES) + 1) + "|")
    for n, by_mode in rows.items():
        print(f"| {n} | " + " | ".join(f"{by_mode[m]:.3f}" for m in MODES) + " |")


if __name__ == "__main__":
    main()
