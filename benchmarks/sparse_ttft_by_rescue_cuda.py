"""The engine's (c) by what the sparse rescue scores against: a 130,944-token prompt's first token
(Llama-3-8B's shape, dummy weights, bf16, 32 layers) with the rescue against keys and against
range boxes, alternated in one engine so that both see the same GPU state, and dense (chunked)
beside them. The first run of each choice warms it up; each prompt is new (no prefix hits).

    python benchmarks/sparse_ttft_by_rescue_cuda.py
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_cuda import prompts, run_engine, write_model_dir  # noqa: E402

from tgserve.server.config.engine_args import EngineArgs  # noqa: E402
from tgserve.server.engine.llm_engine import LLMEngine  # noqa: E402

LENGTH = 131072 - 128  # engine_cuda's (c): the model's context less room to generate
ORDER = ["range-boxes", "keys", "dense", "range-boxes", "keys", "range-boxes", "keys", "dense"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), 32)
        engine = LLMEngine(EngineArgs(model=str(model_dir), load_format="dummy", max_num_seqs=1,
                                      max_model_len=LENGTH + 16, gpu_memory_utilization=0.9, cuda_graphs=False,
                                      enable_prefix_caching=False))  # fmt: skip
        backend = engine.runner.forward.backend
        base = backend.sparse
        configs = {
            against: replace(base, default=replace(base.default, rescue_against=against))
            for against in ("range-boxes", "keys")
        } | {"dense": None}
        times: dict[str, list[float]] = {name: [] for name in configs}
        for seed, name in enumerate(ORDER):
            backend.sparse = configs[name]
            prompt = prompts(1, LENGTH, engine.vocab_size, seed=10 + seed)
            times[name].append(run_engine(engine, prompt, 1)["prefill_s"])
        for name, runs in times.items():
            print(f"| (c) {LENGTH} | {name} | " + " / ".join(f"{s:.3f}" for s in runs) + " s |", flush=True)


if __name__ == "__main__":
    main()
