"""Which 8-bit KV format keeps SmolLM2's greedy tokens (issue 34's agreement measure), before any
kernel is written for it: transformers in float32 with the cache rounded in place to a format.

Each decode step's keys and values (the whole cache, as a cache of that format would hold them) go
through the format; prompt steps attend over their own keys unrounded, as the engine's do. 32 chat
prompts x 32 greedy steps (tgserve.server.testing.agreement), each run's tokens teacher-forced into
the unrounded model: how many steps it predicts the same, and the largest gap where they part.

Formats: e4m3 (the fp8 cache: one float32 scale a token and KV head), e4m3 keys alone, int8 (the
int8 cache), int8 keys with e4m3 values, e4m3 keys less a per-head mean key (a shift softmax
ignores, taken from a calibration text), and e4m3 after an orthonormal Hadamard rotation of queries
and keys (`rotated-keys`; `rotated` turns the values too, and the output back).

    python benchmarks/kv_format_agreement.py --model DIR [--formats e4m3 int8-keys ...]
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import INT8, dequantize_kv, quantize_kv
from tgserve.server.testing.agreement import chat_prompts, count_agreeing, logit_gaps, whole_sequence_logits

CALIBRATION = (
    "The printing press made books cheaper in the fifteenth century. Rivers carry sediment to the sea, "
    "and deltas grow and shift. Bread needs flour, water, salt, yeast and time to rise."
)


def rounded(x: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """x [B, H, T, D] rounded as an 8-bit cache of `dtype` stores it (`kv_format.quantize_kv`)."""
    rows = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1])
    back = dequantize_kv(*quantize_kv(rows, dtype))
    return back.view(x.shape[0], x.shape[2], x.shape[1], -1).transpose(1, 2)


class RoundedCache:
    """The attention function that rounds the cache: `fmt` names the format, `mean_keys` holds each
    layer's [H, D] mean key for the centred format, `collected` gathers keys while calibrating."""

    def __init__(self) -> None:
        self.fmt = "none"
        self.mean_keys: dict[int, torch.Tensor] = {}
        self.collected: dict[int, list[torch.Tensor]] | None = None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if self.collected is not None:  # every position but the sink's
            self.collected.setdefault(module.layer_idx, []).append(key[0, :, 1:].transpose(0, 1))
        if query.shape[2] == 1 and self.fmt.startswith("rotated"):
            return self.rotated(module, query, key, value, attention_mask, **kwargs)
        if query.shape[2] == 1 and self.fmt != "none":
            key, value = self.keys(module.layer_idx, key), self.values(value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def rotated(self, module, query, key, value, attention_mask, **kwargs):
        """Queries and keys (and with "rotated", values; the output turned back) times an
        orthonormal Hadamard matrix before the keys are rounded: scores and output are unchanged
        unrounded, and each rounded key's error is spread over every channel."""
        h = hadamard(query.shape[-1]).to(query.dtype)
        query, key = query @ h, rounded(key @ h)
        if self.fmt == "rotated-keys":
            return sdpa_attention_forward(module, query, key, rounded(value), attention_mask, **kwargs)
        out, weights = sdpa_attention_forward(
            module, query, key, rounded(value @ h), attention_mask, **kwargs
        )
        return out @ h.T, weights

    def keys(self, layer: int, key: torch.Tensor) -> torch.Tensor:
        if self.fmt.startswith("int8"):
            return rounded(key, INT8)
        if self.fmt == "e4m3-centred":
            mean = self.mean_keys[layer][None, :, None, :]
            return rounded(key - mean) + mean
        return rounded(key)

    def values(self, value: torch.Tensor) -> torch.Tensor:
        if self.fmt == "e4m3-keys":
            return value
        return rounded(value, INT8 if self.fmt == "int8" else FP8)


def hadamard(n: int) -> torch.Tensor:
    """The n x n Hadamard matrix (n a power of two), scaled to be orthonormal."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n**0.5


@torch.no_grad()
def greedy(model, prompt: list[int], steps: int) -> list[int]:
    cache, tokens = DynamicCache(), []
    logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return tokens


@torch.no_grad()
def calibrate(model, tokenizer, rounding: RoundedCache) -> None:
    rounding.collected = {}
    model(torch.tensor([chat_prompts(tokenizer, [CALIBRATION])[0]]))
    rounding.mean_keys = {layer: torch.cat(keys).mean(0) for layer, keys in rounding.collected.items()}
    rounding.collected = None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a model directory (the tests' SmolLM2 copy)")
    parser.add_argument(
        "--formats", nargs="+", default=["e4m3", "e4m3-keys", "int8", "int8-keys", "e4m3-centred"]
    )
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    rounding = RoundedCache()
    AttentionInterface.register("rounded_cache", rounding)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="rounded_cache"
    )
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    calibrate(model.eval(), tokenizer, rounding)
    prompts = chat_prompts(tokenizer)
    for fmt in args.formats:
        rounding.fmt = fmt
        tokens = [greedy(model, p, args.steps) for p in prompts]
        logits = [whole_sequence_logits(reference.eval(), p, t) for p, t in zip(prompts, tokens, strict=True)]
        picks = [rows.argmax(-1).tolist() for rows in logits]
        gap = max(max(logit_gaps(rows, t)) for rows, t in zip(logits, tokens, strict=True))
        print(json.dumps({"format": fmt, "agree": count_agreeing(picks, tokens), "steps": len(prompts) * args.steps,
                          "largest_gap_logits": round(gap, 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
