"""Which Triton kernels a CUDA engine compiles after start-up, and what its first requests pay.

Runs Llama-3-8B's shape on dummy weights (as `engine_cuda.py`): engine start (profiling pass,
decode graphs, warm-up requests), then (a) one 512-token prompt with 256 new tokens and (b) 256
such prompts with 128, each twice; with --long-prompt N, then (c) one N-token prompt twice, at the
model's own length limit (so that long prompts are prefilled whole and sparse, and the profiling
pass runs a whole prompt of the model's length). Every in-process Triton compile is logged with its phase; the
ones after start are what a client's request would wait for. Run with an empty Triton cache to see
a fresh container:

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/first_use_compiles.py [--no-warm-up]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).parent))
import engine_cuda as bench  # noqa: E402

from tgserve.kernels.testing import compiled_kernel_name  # noqa: E402
from tgserve.server.config.engine_args import EngineArgs  # noqa: E402
from tgserve.server.engine.llm_engine import LLMEngine  # noqa: E402

PHASES = [
    ("a", 1, 512, 256, 0),
    ("b", 256, 512, 128, 1),
    ("a again", 1, 512, 256, 4),
    ("b again", 256, 512, 128, 2),
]


class CompileLog:
    """Triton's jit cache hook: prints each compile with the phase it fell in (and, after start,
    the engine frames that launched it); never stops the compile."""

    def __init__(self) -> None:
        self.phase = "start"
        self.after_start: list[str] = []
        self.t0 = time.perf_counter()

    def __call__(self, *args, fn=None, key=None, **kwargs) -> bool:
        name = compiled_kernel_name(fn)
        line = f"{time.perf_counter() - self.t0:8.2f}s [{self.phase}] {name}"
        if self.phase != "start":
            frames = [f for f in traceback.extract_stack() if "tgserve" in f.filename][-6:]
            where = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames))
            line += f" {key} from {where}"
            self.after_start.append(name)
        print("compile", line, flush=True)
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-warm-up", action="store_true", help="start the engine without its warm-up requests"
    )
    parser.add_argument("--long-prompt", type=int, default=0, help="also two prompts of this many tokens")
    args = parser.parse_args()
    phases = PHASES + (
        [("c", 1, args.long_prompt, 2, 10), ("c again", 1, args.long_prompt, 2, 11)]
        if args.long_prompt
        else []
    )
    log = CompileLog()
    triton.knobs.runtime.jit_cache_hook = log
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench.write_model_dir(Path(tmp), 32)
        start = time.perf_counter()
        engine = LLMEngine(
            EngineArgs(model=str(model_dir), load_format="dummy", max_num_seqs=256, max_num_batched_tokens=16384,
                       max_model_len=None if args.long_prompt else 8192, warm_up=False if args.no_warm_up else None)
        )  # fmt: skip
        print(f"start-up {time.perf_counter() - start:.2f} s", flush=True)
        for name, count, length, new, seed in phases:
            log.phase = name
            result = bench.run_engine(engine, bench.prompts(count, length, engine.vocab_size, seed=seed), new)
            print(
                f"{name}: first token {result['prefill_s']:.3f} s, total {result['total_s']:.3f} s",
                flush=True,
            )
    print(f"kernels compiled after start-up: {len(log.after_start)} {sorted(set(log.after_start))}")


if __name__ == "__main__":
    main()
