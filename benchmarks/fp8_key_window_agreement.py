"""How much of an fp8 KV cache's disagreement comes from the keys a query attends most (issue 34):
SmolLM2's greedy steps with its keys stored as e4m3 rows (`kv_format.quantize_kv`) except, for
each query, a window of its W most recent keys and the first S keys (sinks), kept exact.

SmolLM2-135M-Instruct (the shipped GGUF, float32) generates 32 greedy tokens for each of the 32
agreement prompts (`server/testing/agreement.py`) with exact attention; each sequence is then run
once more, whole, with the emulated cache, and a step agrees where its argmax is the exact model's
(teacher-forced, as `count_agreeing` counts the engine's). Values stay exact: keys carry nearly all
of the fp8 cache's disagreement (docs/benchmarks/2026-12-02-fp8-kv-cache-h200.md). Window 0 with
no sinks is today's fp8 cache's keys; it gives the engine's own count (989 of 1,024).

    python benchmarks/fp8_key_window_agreement.py [--specs 0,0 16,0 32,0 16,4 32,4]
"""

from __future__ import annotations

import argparse

import torch

from tgserve.kernels.kv_format import dequantize_kv, quantize_kv
from tgserve.server.testing.agreement import TOPICS, chat_prompts

NEW_TOKENS = 32


def load_model(setting: dict):
    """SmolLM2 whose attention keeps keys exact within setting["window"] of each query and before
    setting["sinks"], e4m3 elsewhere (window None: exact attention through SDPA)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tgserve.server.testing.smollm2 import smollm2_checkpoint

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if setting["window"] is None:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, **kwargs
            )
        q, k, v = query[0], key[0], value[0]  # [H, n, d], [Hkv, n, d], [Hkv, n, d]
        stored = dequantize_kv(*quantize_kv(k.transpose(0, 1))).transpose(0, 1)
        group = q.shape[0] // k.shape[0]
        k, stored, v = (t.repeat_interleave(group, 0) for t in (k, stored, v))
        i = torch.arange(q.shape[1])
        exact = (i[:, None] - i[None, :] < setting["window"]) | (i[None, :] < setting["sinks"])
        scores = torch.where(exact, q @ k.transpose(1, 2), q @ stored.transpose(1, 2)) * scaling
        scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
        return (torch.softmax(scores, -1) @ v).transpose(0, 1)[None], None

    AttentionInterface.register("tgserve_key_window", attention)
    path = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="tgserve_key_window"
    )
    return model.eval(), AutoTokenizer.from_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--specs", nargs="+", default=["0,0", "1,0", "16,0", "32,0", "16,4", "32,4"],
                        help="window,sinks pairs")  # fmt: skip
    args = parser.parse_args()
    setting: dict = {"window": None, "sinks": 0}
    model, tokenizer = load_model(setting)
    with torch.inference_mode():
        sequences = [
            (len(p), model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0])
            for p in chat_prompts(tokenizer, TOPICS)
        ]
        exact = [model(s[None]).logits[0, n - 1 : -1].argmax(-1) for n, s in sequences]
        print("| recent keys exact | sinks exact | steps agreeing |\n|---|---|---|")
        for spec in args.specs:
            window, sinks = (int(x) for x in spec.split(","))
            setting.update(window=window, sinks=sinks)
            agree = sum(
                int((model(s[None]).logits[0, n - 1 : -1].argmax(-1) == e).sum())
                for (n, s), e in zip(sequences, exact, strict=True)
            )
            setting["window"] = None
            print(f"| {window} | {sinks} | {agree}/{len(sequences) * NEW_TOKENS} |", flush=True)


if __name__ == "__main__":
    main()
