"""How often SmolLM2's greedy steps with an fp8 KV cache agree with the model's own-dtype cache
(issue 34, fp8 KV acceptance), on the GPU's kernels.

32 chat prompts x 32 greedy steps (tgserve.server.testing.agreement), the engine once per KV cache
dtype and model dtype, each run's tokens teacher-forced into transformers in the model's dtype
(one forward over each whole sequence): how many steps it predicts the same, and where they part,
how far below its largest logit the engine's token lies (in logit units, and for bf16 in the
logits' rounding steps). The model-dtype cache's own agreement is the scale of the near-ties the
fp8 cache adds to.

Run on a GPU: python benchmarks/fp8_kv_agreement.py --gguf PATH
"""

from __future__ import annotations

import argparse
import gc
import json

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        runs = {}
        for kv in ("auto", "fp8"):
            engine = LLMEngine(EngineArgs(model=args.gguf, dtype=dtype, max_num_seqs=32, device="cuda",
                                          kv_cache_dtype=kv))  # fmt: skip
            prompts = chat_prompts(engine.tokenizer)
            runs[kv] = engine_greedy(engine, prompts, args.steps)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        model = AutoModelForCausalLM.from_pretrained(args.gguf.rsplit("/", 1)[0], gguf_file=args.gguf.rsplit("/", 1)[1],
                                                     **dtype_kwargs(getattr(torch, dtype))).cuda().eval()  # fmt: skip
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
        torch.cuda.empty_cache()
    print("| model dtype | KV cache | steps agreeing | largest gap, logits | largest gap, rounding steps |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model_dtype']} | {r['kv_cache_dtype']} | {r['agree']}/{r['steps']} | {r['largest_gap_logits']} | "
              f"{r['largest_gap_steps']:.3g} |")  # fmt: skip


if __name__ == "__main__":
    main()
