"""Families on native layers beyond Llama's own, each against transformers' greedy tokens (tiny,
random, float32, CPU): Phi-3 (fused checkpoint projections split on load, a sliding window) and
Gemma 2 (its norms, scaled embeddings, soft-capped attention and logits, alternating windows);
configurations the native layers do not compute are left to the fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tgserve.server.engine.llm import LLM
from tgserve.server.models.gemma import GemmaForCausalLM
from tgserve.server.models.llama import LlamaForCausalLM
from tgserve.server.models.moe import MoEForCausalLM
from tgserve.server.models.registry import native_model_class
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.arch_sweep import saved_tiny_model

NEW_TOKENS = 12
PROMPTS = [list(range(5, 22)), list(range(5, 13)) + [30, 31]]  # the second hits the first's blocks


def transformers_tokens(model: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probabilities (from the raw logits: a monotone change of the
    logits, as a final soft-cap is, shows only there)."""
    results = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=model.config.pad_token_id, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens, strict=True)
        ]
        results.append((tokens, logprobs))
    return results


def engine_tokens(directory: Path, native: type) -> list[tuple[list[int], list[float]]]:
    llm = LLM(
        str(directory), dtype="float32", device="cpu", max_num_batched_tokens=8, block_size=8, num_blocks=64
    )
    assert type(llm.engine.shard.forward.model) is native
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = [llm.generate([p], params)[0] for p in PROMPTS]
    return [(out.token_ids, [entry.logprob for entry in out.logprobs]) for out in outputs]


@pytest.mark.parametrize(
    "model_type,architecture,native,overrides",
    [
        # A window shorter than the prompts: it decides what is attended.
        ("phi3", "Phi3ForCausalLM", LlamaForCausalLM, {"sliding_window": 6}),
        # Caps low enough to bend random weights' scores and logits; windows on every other layer.
        ("gemma2", "Gemma2ForCausalLM", GemmaForCausalLM,
         {"sliding_window": 6, "attn_logit_softcapping": 0.02, "final_logit_softcapping": 2.0}),
        # Query and key norms, a RoPE per layer type: bases far apart, the global one scaled.
        ("gemma3_text", "Gemma3ForCausalLM", GemmaForCausalLM,
         {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
             "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}}}),
        # Mixtures of experts: more experts than a step's rows choose, two a token; a dense layer
        # among sparse ones (Qwen's mlp_only_layers), renormalised weights or not, a shared expert.
        ("qwen3_moe", "Qwen3MoeForCausalLM", MoEForCausalLM,
         {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 3,
          "mlp_only_layers": [1]}),
        ("qwen2_moe", "Qwen2MoeForCausalLM", MoEForCausalLM,
         {"num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1}),
        ("mixtral", "MixtralForCausalLM", MoEForCausalLM,
         {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6}),
    ],
)  # fmt: skip
def test_a_native_family_gives_transformers_tokens(tmp_path, model_type, architecture, native, overrides):
    model = saved_tiny_model(model_type, architecture, tmp_path, **overrides)
    got, want = engine_tokens(tmp_path, native), transformers_tokens(model)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want, strict=True):
        assert got_logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_phi3_with_long_context_rope_is_left_to_the_fallback():
    config = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, original_max_position_embeddings=64, max_position_embeddings=256,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    )  # fmt: skip
    assert native_model_class("Phi3ForCausalLM", config) is None
    assert native_model_class("Phi3ForCausalLM", transformers.Phi3Config()) is LlamaForCausalLM
