"""GPU benchmark (issue 34): the memory a whole long prompt's step needs, and what it leaves for the
KV cache, at Llama-3-8B's shape with its context stretched (dummy weights, bf16).

The engine profiles, at start-up, a whole prompt of the model's length (the step sparse prefill
needs) beside the token budget's step, and sizes the KV pool with the smaller budget; where the
whole prompt's step leaves less than one such request's KV, long prompts are chunked instead. This
prints, per context length, that step's activation peak and the KV budget it leaves, whether such
prompts are prefilled whole, and the pool's size. JSON lines, then a Markdown table.

--unsliced-attention runs the attention's projections over the whole step at once, as before its
token-wise parts ran in slices of `ROWS_AT_ONCE` rows: the baseline, in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_cuda import LLAMA3_8B  # noqa: E402

from tgserve.server.attention.forward_context import paged_attention  # noqa: E402
from tgserve.server.config.engine_args import EngineArgs  # noqa: E402
from tgserve.server.engine.llm_engine import LLMEngine  # noqa: E402
from tgserve.server.models import llama  # noqa: E402
from tgserve.server.testing.tiny_tokenizer import save_fast_tokenizer  # noqa: E402

GIB = 1 << 30


def model_dir(root: Path, context: int, layers: int) -> Path:
    directory = root / f"llama3-8b-shape-{context}"
    directory.mkdir(parents=True, exist_ok=True)
    config = {**LLAMA3_8B, "num_hidden_layers": layers, "max_position_embeddings": context}
    (directory / "config.json").write_text(json.dumps(config))
    save_fast_tokenizer(directory)
    return directory


def unsliced_attention(self, positions, hidden, keep=None):  # noqa: ANN001, ANN201
    """LlamaAttention.forward as it was: queries, keys, values and the output projection at once."""
    q, k, v = self._qkv(positions, hidden)
    out = paged_attention(self.layer_idx, q, k, v, self.scale, rows=keep)
    return self.o_proj(out.reshape(-1, self.q_size))


def measure(context: int, layers: int, utilization: float, kv_cache_dtype: str = "auto") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        engine = LLMEngine(
            EngineArgs(
                model=str(model_dir(Path(tmp), context, layers)),
                load_format="dummy",
                max_model_len=context,
                gpu_memory_utilization=utilization,
                cuda_graphs=False,
                warm_up=False,
                kv_cache_dtype=kv_cache_dtype,
            )
        )
        seconds = time.perf_counter() - start
    shard, profile = engine.shard, engine.shard.whole_prompt_profile
    return {
        "context": context,
        "whole_step_activation_gib": None
        if profile is None
        else round(profile.activation_peak_bytes / GIB, 2),
        "whole_step_leaves_gib": None if profile is None else round(profile.kv_budget_bytes / GIB, 2),
        "prefilled_whole_from": shard.whole_prompt_tokens,
        "pool_tokens": engine.num_blocks * engine.args.block_size,
        "startup_s": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--unsliced-attention", action="store_true", help="the baseline")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    args = parser.parse_args()
    if args.unsliced_attention:
        llama.LlamaAttention.forward = unsliced_attention
    rows = []
    for context in args.contexts:
        rows.append(measure(context, args.layers, args.gpu_memory_utilization, args.kv_cache_dtype))
        print(json.dumps(rows[-1]), flush=True)
    print(
        "| context | whole step's activation peak, GiB | it leaves for KV, GiB | prefilled whole from | pool tokens |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']:,} | {r['whole_step_activation_gib']} | {r['whole_step_leaves_gib']} | "
              f"{r['prefilled_whole_from']} | {r['pool_tokens']:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
