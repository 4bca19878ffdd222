"""Phi-3 on the native llama layers: its fused checkpoint projections split on load, its sliding
window applied, and the RoPE the native layers do not compute (longrope) left to the fallback."""

from __future__ import annotations

import shutil

import torch
import transformers

from tgserve.server.engine.llm import LLM
from tgserve.server.models.llama import LlamaForCausalLM
from tgserve.server.models.registry import native_model_class
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.arch_sweep import tiny_config
from tgserve.server.testing.fixtures import _token_ids, _tokenizer_dir, default_cache_dir

NEW_TOKENS = 12


def test_phi3_runs_natively_with_transformers_tokens_past_its_sliding_window(tmp_path):
    tokenizer_dir = _tokenizer_dir(default_cache_dir())
    config = tiny_config("phi3", _token_ids(tokenizer_dir))
    config.sliding_window = 6  # shorter than the prompts: the window decides what is attended
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).float().eval()
    model.save_pretrained(tmp_path)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    prompts = [list(range(5, 22)), list(range(5, 13)) + [30, 31]]
    want = [
        model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                       pad_token_id=config.pad_token_id)[0, len(p):].tolist()
        for p in prompts
    ]  # fmt: skip
    llm = LLM(
        str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=8, block_size=8, num_blocks=64
    )
    assert type(llm.engine.shard.forward.model) is LlamaForCausalLM
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [llm.generate([p], params)[0].token_ids for p in prompts] == want


def test_phi3_with_long_context_rope_is_left_to_the_fallback():
    config = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, original_max_position_embeddings=64, max_position_embeddings=256,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    )  # fmt: skip
    assert native_model_class("Phi3ForCausalLM", config) is None
    assert native_model_class("Phi3ForCausalLM", transformers.Phi3Config()) is LlamaForCausalLM
