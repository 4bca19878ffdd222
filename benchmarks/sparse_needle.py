"""Needle in a haystack through sparse prefill, with a real model (issue 36): does the sparse pattern
(and its tail) keep a fact planted mid-prompt that only the question at the end asks for?

SmolLM2-135M-Instruct (the shipped GGUF, through transformers) reads a ~8K-token haystack of the
standard library's prose with a needle at a chosen depth (`server/testing/needle.py`), then answers
greedily. The prompt's attention is replaced, in every layer, by the sparse path's torch twin
(`sparse_prefill(use_triton=False)`: the estimated index and, with "tail": true, the tail) or, on
a GPU, the Triton path; decode steps attend densely. Methods: dense, then each --pattern (JSON
fields of HeadPattern over the default). At 8K tokens the default budget (1,000 columns, 6,096
diagonals) holds nearly everything, so the default pattern here is scaled to a 128K prompt's share
of keys at the default budget (about 5%): 64 columns and 384 diagonals a head.

    python benchmarks/sparse_needle.py [--placements 12] [--haystack-tokens 7000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tgserve.kernels.sparse.attention import sparse_prefill
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.server.testing.needle import needle_prompt, placements

# The default pattern's budgets scaled to a 128K prompt's share of keys; its rescue split as is.
SCALED_DOWN = {"vertical": 64, "slash": 384, "sink": 64, "local": 128}
METHODS = {
    "sparse": SCALED_DOWN,
    "sparse, rescue by the mean": SCALED_DOWN | {"rescue": 2, "rescue_range": 0},  # the default before
    "sparse + tail": SCALED_DOWN | {"tail": True},
}


def load_model(device: str, pattern_of: dict):
    """SmolLM2 through transformers with the sparse path as its prompt attention; `pattern_of`
    ["pattern"] says the current method's HeadPattern (None: dense)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tgserve.server.testing.smollm2 import smollm2_checkpoint

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        pattern = pattern_of["pattern"]
        if pattern is None or query.shape[2] != key.shape[2]:  # dense, or a decode step
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, **kwargs
            )
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [n, heads, d]
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        out = sparse_prefill(
            q, k, v, scale, [pattern] * q.shape[1], block=64, last_q=64, use_triton=q.is_cuda
        )
        return out[None], None  # [1, n, heads, d]

    AttentionInterface.register("tgserve_sparse_needle", attention)
    path = smollm2_checkpoint()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="tgserve_sparse_needle"
    )
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--placements", type=int, default=12)
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N placements (resume a run)")
    parser.add_argument("--haystack-tokens", type=int, default=7000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="+", choices=["dense", *METHODS], default=["dense", *METHODS])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    pattern_of: dict = {"pattern": None}
    model, tokenizer = load_model(args.device, pattern_of)
    every = {"dense": None} | {name: HeadPattern(**fields) for name, fields in METHODS.items()}
    methods = {name: every[name] for name in args.methods}
    rows = []
    for placement in placements(args.placements)[args.skip :]:
        prompt = torch.tensor([needle_prompt(tokenizer, placement, args.haystack_tokens)], device=args.device)
        row = {"depth": placement.depth, "number": placement.number, "prompt_tokens": prompt.shape[1]}
        for name, pattern in methods.items():
            pattern_of["pattern"] = pattern
            start = time.perf_counter()
            with torch.inference_mode():
                tokens = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1] :]
            reply = tokenizer.decode(tokens, skip_special_tokens=True)
            row[name] = {
                "found": str(placement.number) in reply,
                "reply": reply,
                "s": time.perf_counter() - start,
            }
        rows.append(row)
        print(json.dumps({k: (v["found"] if isinstance(v, dict) else v) for k, v in row.items()}), flush=True)
    found = {name: sum(r[name]["found"] for r in rows) for name in methods}
    dense_found = [r for r in rows if "dense" in r and r["dense"]["found"]]
    kept = {name: sum(r[name]["found"] for r in dense_found) for name in methods}
    lines = ["| method | found | of dense's finds kept |", "|---|---|---|"]
    lines += [f"| {name} | {found[name]}/{len(rows)} | {kept[name]}/{len(dense_found)} |" for name in methods]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sparse_needle.json").write_text(
            json.dumps({"patterns": METHODS, "rows": rows}, indent=1)
        )
        (args.out / "sparse_needle.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
