"""How often SmolLM2's greedy steps with an 8-bit KV cache (fp8, or int8) agree with the model's
own-dtype cache (issue 34, fp8 KV acceptance), on the GPU's kernels or the CPU's.

32 chat prompts x 32 greedy steps (tgserve.server.testing.agreement), the engine once per KV cache
dtype and model dtype, each run's tokens teacher-forced into transformers in the model's dtype
(one forward over each whole sequence): how many steps it predicts the same, and where they part,
how far below its largest logit the engine's token lies (in logit units, and for bf16 in the
logits' rounding steps). The model-dtype cache's own agreement is the scale of the near-ties the
fp8 cache adds to.

An 8-bit cache keeps each sequence's current block in the model's dtype too (`--kv-cache-tail`,
on by default); a name with ":no-tail" (e.g. fp8:no-tail) runs it without.

Run on a GPU: python benchmarks/fp8_kv_agreement.py --gguf PATH (--device cpu: the CPU backend)
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.testing.agreement import (
    chat_prompts,
    count_agreeing,
    engine_greedy,
    logit_gaps,
    summarise_gaps,
    whole_sequence_logits,
)


def load_reference(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model from the GGUF file, or from a model directory (the tests' converted copy)."""
    if Path(path).is_dir():
        return AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs(dtype))
    folder, name = path.rsplit("/", 1)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **dtype_kwargs(dtype))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", required=True, help="the GGUF file, or a model directory")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (the CPU backend's kernels)")
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=["auto", "fp8"],
        help="auto, fp8, int8; fp8:no-tail, int8:no-tail",
    )
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        runs = {}
        for kv in args.kv_cache_dtypes:
            name, _, option = kv.partition(":")
            engine = LLMEngine(EngineArgs(model=args.gguf, dtype=dtype, max_num_seqs=32, device=args.device,
                                          kv_cache_dtype=name, kv_cache_tail=option != "no-tail"))  # fmt: skip
            prompts = chat_prompts(engine.tokenizer)
            runs[kv] = engine_greedy(engine, prompts, args.steps)
            del engine
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        model = load_reference(args.gguf, getattr(torch, dtype)).to(args.device).eval()
        for kv, tokens in runs.items():
            with torch.no_grad():
                logits = [whole_sequence_logits(model, p, t) for p, t in zip(prompts, tokens, strict=True)]
            picks = [r.argmax(-1).tolist() for r in logits]
            row = {"model_dtype": dtype, "kv_cache_dtype": kv, "agree": count_agreeing(picks, tokens),
                   "steps": len(prompts) * args.steps, "largest_gap_logits": round(max(max(logit_gaps(r, t)) for r, t in zip(logits, tokens)), 3),
                   **summarise_gaps(logits, tokens)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print("| model dtype | KV cache | steps agreeing | largest gap, logits | largest gap, rounding steps |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model_dtype']} | {r['kv_cache_dtype']} | {r['agree']}/{r['steps']} | {r['largest_gap_logits']} | "
              f"{r['largest_gap_steps']:.3g} |")  # fmt: skip


if __name__ == "__main__":
    main()
