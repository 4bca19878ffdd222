"""Multimodal checkpoints (image-text-to-text: Gemma 3, Mistral Small 3.1, Qwen3.5, ...) are served
for text by their language model alone (`loading/language_model.py`): token-exact with the
published class's own text-only `generate`, through chunked prefill, preemption and prefix hits."""

from __future__ import annotations

import json

import pytest
import transformers
from transformers import AutoConfig

from tgserve.router.tokenization import RouterTokenizer
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.errors import ModelLoadError
from tgserve.server.loading.language_model import (
    language_model_config,
    language_model_key_mapping,
    language_model_weights,
)
from tgserve.server.loading.source import ModelSource, load_tokenizer
from tgserve.server.models.registry import UnsupportedModelError
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.arch_sweep import copy_tokenizer, saved_tiny_multimodal_model
from tgserve.server.testing.fixtures import _tokenizer_dir, default_cache_dir

from .parity import assert_scenario_parity, build_requests

PROMPT_LENGTHS = [40, 12, 70, 25, 9, 50, 33, 30]
TIGHT = dict(max_num_batched_tokens=32, block_size=8, num_blocks=24, dtype="float32", device="cpu")
PUBLISHED = [
    ("gemma3", "Gemma3ForConditionalGeneration"),  # native Gemma 3; `language_model.model.*` weights
    ("mistral3", "Mistral3ForConditionalGeneration"),  # native llama family (Mistral)
    ("qwen3_5", "Qwen3_5ForConditionalGeneration"),  # fallback, state kept; `model.language_model.*`
    ("gemma4", "Gemma4ForConditionalGeneration"),  # fallback; its towers optional (none here)
    ("emu3", "Emu3ForConditionalGeneration"),  # fallback; `text_model.model.*` weights, a VQ-GAN beside
    ("phi4_multimodal", "Phi4MultimodalForCausalLM"),  # fallback, whole: the text settings at the top level
]


@pytest.mark.parametrize("model_type,architecture", PUBLISHED)
def test_a_multimodal_checkpoint_serves_its_language_model_for_text(tmp_path, model_type, architecture):
    hf_model = saved_tiny_multimodal_model(model_type, architecture, tmp_path)
    engine = LLMEngine(EngineArgs(model=str(tmp_path), **TIGHT))
    text_type = AutoConfig.for_model(model_type).get_text_config().model_type
    assert engine.config.model_type == text_type
    assert_scenario_parity(engine, hf_model, build_requests(engine.vocab_size, PROMPT_LENGTHS))


def test_language_model_weights_take_either_layout_and_leave_the_vision_tower_out():
    weights = [
        ("language_model.model.layers.0.mlp.up_proj.weight", 1),
        ("model.language_model.embed_tokens.weight", 2),
        ("language_model.lm_head.weight", 3),
        ("lm_head.weight", 4),
        ("vision_tower.encoder.layers.0.mlp.fc1.weight", 5),
        ("model.visual.patch_embed.proj.weight", 6),
        ("multi_modal_projector.linear_1.weight", 7),
        ("text_model.model.norm.weight", 8),
        ("text_model.lm_head.weight", 9),
        ("vqmodel.encoder.conv_in.weight", 10),
    ]
    assert list(language_model_weights(weights)) == [
        ("model.layers.0.mlp.up_proj.weight", 1),
        ("model.embed_tokens.weight", 2),
        ("lm_head.weight", 3),
        ("lm_head.weight", 4),
        ("model.norm.weight", 8),
        ("lm_head.weight", 9),
    ]


def test_a_checkpoint_that_lacks_language_model_weights_is_refused_not_served_at_random(tmp_path):
    """transformers fills the weights a checkpoint lacks at random and only warns; the fallback's
    load refuses such a checkpoint, naming what is missing."""
    from safetensors.torch import load_file, save_file

    saved_tiny_multimodal_model("gemma4", "Gemma4ForConditionalGeneration", tmp_path)
    copy_tokenizer(_tokenizer_dir(default_cache_dir()), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    gone = next(name for name in weights if name.endswith("layers.1.mlp.up_proj.weight"))
    del weights[gone]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 weights .*layers\.1\.mlp\.up_proj\.weight"):
        LLMEngine(EngineArgs(model=str(tmp_path), **TIGHT))


def test_a_language_model_without_a_causal_lm_class_is_refused_by_name(tmp_path):
    config = AutoConfig.for_model("qwen2_5_vl")  # its text model (M-RoPE Qwen2) has no causal-LM class
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ModelLoadError, match="qwen2_5_vl_text"):
        language_model_config(config, ModelSource(tmp_path))


def test_a_text_model_is_left_as_it_is(tmp_path):
    config = AutoConfig.for_model("llama")
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert language_model_config(config, ModelSource(tmp_path)) is None


def test_llama_4s_language_model_gives_its_text_class_tokens(tmp_path):
    """transformers' own `Llama4ForConditionalGeneration.generate` fails on text alone (5.24: its
    output has no `image_outputs`), so the reference is `Llama4ForCausalLM` over the checkpoint's
    language-model weights."""
    published = saved_tiny_multimodal_model("llama4", "Llama4ForConditionalGeneration", tmp_path)
    text_model = transformers.Llama4ForCausalLM.from_pretrained(
        tmp_path, config=published.config.get_text_config(), key_mapping=language_model_key_mapping()
    )
    engine = LLMEngine(EngineArgs(model=str(tmp_path), **TIGHT))
    assert_scenario_parity(
        engine, text_model.float().eval(), build_requests(engine.vocab_size, PROMPT_LENGTHS)
    )


def test_a_processors_chat_template_reaches_the_router_and_gets_text_parts(tmp_path):
    """Multimodal checkpoints may keep their chat template only in the processor's
    chat_template.json, often one that loops over content parts (here Llava's kind, lists only)."""
    source, saved = tmp_path / "model", tmp_path / "router"
    source.mkdir()
    tokenizer_dir = _tokenizer_dir(default_cache_dir())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    template = (
        "{% for message in messages %}<{{ message['role'] }}>{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endfor %}"
    )
    (source / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    load_tokenizer(ModelSource(source)).save_pretrained(saved)
    router_tokenizer = RouterTokenizer.from_directory(saved)
    assert router_tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]) == "<user>Hi"


def test_a_draft_model_with_a_text_config_is_left_to_the_registry_which_refuses_it(tmp_path):
    config = AutoConfig.for_model("gemma4_unified_assistant")  # Gemma 4 unified's draft model
    config.architectures = ["Gemma4UnifiedAssistantForCausalLM"]  # a causal LM of the composite config
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert language_model_config(config, ModelSource(tmp_path)) is None
    copy_tokenizer(_tokenizer_dir(default_cache_dir()), tmp_path)
    with pytest.raises(UnsupportedModelError, match="draft model"):
        LLMEngine(EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu"))


def test_a_multimodal_checkpoints_language_model_loads_with_dummy_weights(tmp_path):
    """load_format "dummy" builds the text class from the config alone: Mllama's is named by its
    composite type only (no auto class for its text config)."""
    saved_tiny_multimodal_model("mllama", "MllamaForConditionalGeneration", tmp_path)
    engine = LLMEngine(EngineArgs(model=str(tmp_path), load_format="dummy", **TIGHT))
    assert type(engine.shard.forward.model.hf_model).__name__ == "MllamaForCausalLM"
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 3
