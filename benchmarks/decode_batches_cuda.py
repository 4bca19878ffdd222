"""GPU benchmark: the engine's decode step at small batches of long prompts (several users at once).

    python benchmarks/decode_batches_cuda.py

The engine as served (CUDA graphs, async scheduling) on random weights at Llama-3-8B's shape
(`engine_cuda.py`'s model), bf16, model length 8,192. For each (batch, prompt length): that many
requests at once, 64 new tokens each; prints the median wall time of the steps where every request
decodes, in ms, as one JSON line. (a) and (b) of engine_cuda.py cover batches 1 and 256 only; decode
attention's launch (its context splits) changes between those, which is what this measures. Run
each tree of an A/B in its own process, alternating.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_cuda import prompts, run_engine, write_model_dir  # noqa: E402

from tgserve.server.config.engine_args import EngineArgs  # noqa: E402
from tgserve.server.engine.llm_engine import LLMEngine  # noqa: E402

CASES = ((1, 7000), (2, 7000), (4, 7000), (8, 7000), (16, 7000), (8, 1000), (16, 1000))
NEW_TOKENS = 64


def main() -> None:
    model_dir = write_model_dir(Path(tempfile.mkdtemp()), 32)
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            load_format="dummy",
            max_num_seqs=256,
            max_num_batched_tokens=16384,
            max_model_len=8192,
            gpu_memory_utilization=0.9,
        )
    )
    vocab = engine.vocab_size
    run_engine(engine, prompts(2, 64, vocab, seed=9), 8)  # warm-up: kernels compiled, allocator primed
    steps = {}
    for batch, length in CASES:
        result = run_engine(engine, prompts(batch, length, vocab, seed=batch), NEW_TOKENS)
        steps[f"b{batch}x{length}"] = round(result["decode_step_s"] * 1e3, 3)
    print(json.dumps({"decode_step_ms": steps}), flush=True)


if __name__ == "__main__":
    main()
