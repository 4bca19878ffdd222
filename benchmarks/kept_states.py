"""Models whose layers keep state besides keys and values, served with their state kept between
steps (`server/models/kept_states.py`) beside the same engine recomputing each step's sequence
whole (the kept states turned off), same run: decode ms per token and the first token's time, and
whether both gave the same tokens.

Shapes (random weights, `load_format="dummy"`, float32 on CPU unless --device cuda):
- mamba: Mamba-130M's (24 layers of 768, state 16, vocabulary 50,280);
- qwen3_5: Qwen3.5's layer pattern scaled down (8 layers of 1,024: 6 gated DeltaNet, 2 attention).

One request at a time, prompts of --prompts tokens, --new-tokens greedy tokens each.

    python benchmarks/kept_states.py [--device cuda] [--prompts 256 1024] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from transformers import AutoConfig

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams

SHAPES = {
    "mamba": dict(hidden_size=768, num_hidden_layers=24, state_size=16, vocab_size=50280),
    "qwen3_5": dict(
        model_type="qwen3_5_text",
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        vocab_size=32000,
    ),
}


def model_dir(name: str, directory: str) -> str:
    sizes = dict(SHAPES[name])
    model_type = sizes.pop("model_type", name)
    if "layer_types" in sizes:
        sizes["layer_types"] = sizes["layer_types"] * (
            sizes["num_hidden_layers"] // len(sizes["layer_types"])
        )
    AutoConfig.for_model(model_type, **sizes, bos_token_id=0, eos_token_id=1).save_pretrained(directory)
    return directory


def serve(engine: LLMEngine, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, first token's seconds, decode ms a token) of one request alone."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_request(f"r{time.perf_counter()}", prompt, params)
    tokens, start, first = [], time.perf_counter(), None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        if first is None and tokens:
            first = time.perf_counter() - start
    decode = (time.perf_counter() - start - first) / max(1, len(tokens) - 1)
    return tokens, first, decode * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            engine = LLMEngine(EngineArgs(model=model_dir(name, tmp), load_format="dummy", dtype="float32",
                                          device=args.device, max_num_seqs=4, max_model_len=4096))  # fmt: skip
            model = engine.shard.forward.model
            kept = model.kept_states
            rng = random.Random(0)
            for length in args.prompts:
                prompt = [rng.randrange(10, engine.vocab_size) for _ in range(length)]
                serve(engine, prompt[:8], 2)  # warm up
                model.kept_states = kept
                on = serve(engine, prompt, args.new_tokens)
                model.kept_states = None
                off = serve(engine, prompt, args.new_tokens)
                row = dict(model=name, prompt=length, kept_ttft_s=round(on[1], 3), kept_decode_ms=round(on[2], 2),
                           recomputed_ttft_s=round(off[1], 3), recomputed_decode_ms=round(off[2], 2),
                           same_tokens=on[0] == off[0])  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
            model.kept_states = kept
    print(
        "| model | prompt | decode ms/token, kept | recomputed | speed-up | TTFT s, kept | recomputed | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['prompt']} | {r['kept_decode_ms']} | {r['recomputed_decode_ms']} | "
              f"{r['recomputed_decode_ms'] / r['kept_decode_ms']:.1f}x | {r['kept_ttft_s']} | {r['recomputed_ttft_s']} | "
              f"{r['same_tokens']} |")  # fmt: skip


if __name__ == "__main__":
    main()
