"""Sparse prefill's error on a real model's own attention, layer by layer (issue 36): SmolLM2's
queries, keys and values of a needle prompt, each sampled layer's sparse output against dense.

SmolLM2-135M-Instruct (the shipped GGUF, through transformers, float32) reads a ~7K-token needle
prompt (`server/testing/needle.py`) densely while its attention records every layer's queries,
keys and values (after rotary). Each sampled layer's prompt then goes through the sparse estimate
(the torch twin, as the CPU serves it) for every method, and the masked output is compared with
dense: rel L2 = |sparse - dense| / |dense| over all heads and rows. The budget is scaled to a
128K prompt's share of keys at the default (64 columns, 384 diagonals), as `sparse_needle.py`
does, so the rescue weighs as it would at 128K. Methods differ in the rescue's `rescue_against`.

    python benchmarks/sparse_layer_error.py [--depth 0.45] [--every 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tgserve.kernels import reference
from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.config import RESCUE_AGAINST, HeadPattern
from tgserve.kernels.sparse.index import index_to_mask
from tgserve.server.testing.needle import needle_prompt, placements

SCALED_DOWN = {"vertical": 64, "slash": 384, "sink": 64, "local": 128}


def recorded_attention(depth: float, haystack_tokens: int) -> list[tuple[torch.Tensor, ...]]:
    """(query [n, H, d], key [n, Hkv, d], value [n, Hkv, d], scale) of every layer of SmolLM2 over
    the needle prompt nearest `depth` (dense attention, float32)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tgserve.server.testing.smollm2 import smollm2_checkpoint

    recorded = []

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        recorded.append((*(t[0].transpose(0, 1).clone() for t in (query, key, value)), scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("tgserve_recorded", attention)
    path = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="tgserve_recorded"
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    placement = min(placements(12), key=lambda p: abs(p.depth - depth))
    with torch.inference_mode():
        model(torch.tensor([needle_prompt(tokenizer, placement, haystack_tokens)]))
    return recorded


def layer_error(query, key, value, scale, pattern: HeadPattern) -> float:
    """rel L2 of the sparse twin's output against dense attention over the whole prompt."""
    n = query.shape[0]
    dense = reference.masked_attention(query, key, value, reference.causal_mask(n, n), scale)
    index = estimate_index(query, key, scale, [pattern] * query.shape[1], 64, 64)
    sparse = reference.masked_attention(query, key, value, index_to_mask(index), scale)
    return ((sparse - dense).norm() / dense.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depth", type=float, default=0.45, help="the needle's depth in the haystack")
    parser.add_argument("--haystack-tokens", type=int, default=7000)
    parser.add_argument("--every", type=int, default=4, help="every N-th layer, from layer 0")
    parser.add_argument("--methods", nargs="+", choices=RESCUE_AGAINST, default=list(RESCUE_AGAINST))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    layers = recorded_attention(args.depth, args.haystack_tokens)
    print(f"{len(layers)} layers, {layers[0][0].shape[0]} tokens", flush=True)
    rows = []
    for layer in range(0, len(layers), args.every):
        errors = {
            a: layer_error(*layers[layer], HeadPattern(**SCALED_DOWN, rescue_against=a)) for a in args.methods
        }
        rows.append({"layer": layer} | errors)
        print(json.dumps(rows[-1]), flush=True)
    lines = ["| layer | " + " | ".join(args.methods) + " |", "|---" * (len(args.methods) + 1) + "|"]
    lines += [f"| {r['layer']} | " + " | ".join(f"{r[a]:.4f}" for a in args.methods) + " |" for r in rows]
    means = [sum(r[a] for r in rows) / len(rows) for a in args.methods]
    lines.append("| mean | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sparse_layer_error.json").write_text(
            json.dumps({"pattern": SCALED_DOWN, "rows": rows}, indent=1)
        )
        (args.out / "sparse_layer_error.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
