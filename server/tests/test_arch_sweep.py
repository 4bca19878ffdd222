"""A sample of the architecture sweep in the suite (`make test-arch` runs every architecture the
installed transformers knows and writes docs/architectures.md): each builds tiny from its own config
class and gives transformers' greedy tokens through the engine; what the engine does not serve is
refused by name."""

from __future__ import annotations

import pytest
import torch

from tgserve.server.kv_cache.spec import kv_cache_specs
from tgserve.server.testing.arch_sweep import Refused, run_one, tiny_config
from tgserve.server.testing.tiny_configs import TokenIds

# Families the fixtures do not cover, or cover with their own hand-made configs.
SAMPLE = [
    ("gpt_neox", "GPTNeoXForCausalLM"),
    ("phi3", "Phi3ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("gemma2", "Gemma2ForCausalLM"),
    ("mixtral", "MixtralForCausalLM"),
    ("opt", "OPTForCausalLM"),
    ("deepseek_v2", "DeepseekV2ForCausalLM"),  # latent attention: keys and values of two widths
    ("deepseek_v3", "DeepseekV3ForCausalLM"),  # latent attention, its rotary width tied to head_dim
    ("gptj", "GPTJForCausalLM"),  # rotary on part of each head (rotary_dim)
    ("bloom", "BloomForCausalLM"),  # ALiBi, through the path that bypasses the attention interface
    ("exaone", "LlamaForCausalLM"),  # native, from a checkpoint in EXAONE's own names (renamed on load)
    ("openai-gpt", "OpenAIGPTLMHeadModel"),  # no KV cache at all: whole sequences, recomputed
    ("xlnet", "XLNetLMHeadModel"),  # its own inputs for generation (a permutation mask), recomputed
    ("gemma4_text", "Gemma4ForCausalLM"),  # per-layer configs: full-attention layers' heads twice as wide
    ("gemma3n_text", "Gemma3nForCausalLM"),  # the last layers reuse earlier layers' KV; per-layer inputs
    ("mimo_v2_flash", "MiMoV2FlashForCausalLM"),  # sliding layers with twice the KV heads, and sinks
    ("dory", "DoryForCausalLM"),  # a stack of layers looped twice, each loop with its own KV
    ("gemma3n", "Gemma3nForConditionalGeneration"),  # its language model from a composite checkpoint
    ("phi4_multimodal", "Phi4MultimodalForCausalLM"),  # served whole: text settings beside its towers
    # Layers with state the paged cache cannot hold: served by recomputation, with their own attention.
    ("mamba", "MambaForCausalLM"),  # a state-space model, no attention at all
    ("qwen3_5_text", "Qwen3_5ForCausalLM"),  # gated DeltaNet (linear attention) among attention layers
    ("qwen4_exp_text", "Qwen4ExpForCausalLM"),  # calls its rotary by keyword, for queries alone
]
GEMMA_4_LAYERS = dict(layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4)


@pytest.mark.parametrize("model_type,architecture", SAMPLE)
def test_a_tiny_model_of_the_family_gives_transformers_tokens(tmp_path, model_type, architecture):
    row = run_one(model_type, architecture, tmp_path)
    assert row.status == "exact", row


@pytest.mark.parametrize(
    "variant",
    [
        # Gemma 4's small models: the last two layers reuse the KV of the last earlier layer of their
        # kind; full-attention layers take keys as values, with a KV head of their own count.
        dict(num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1),
        dict(
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
        ),  # 26B-A4B's MoE
    ],
    ids=["shared-kv", "moe"],
)
def test_gemma_4_variants_give_transformers_tokens(tmp_path, variant):
    row = run_one("gemma4_text", "Gemma4ForCausalLM", tmp_path, **GEMMA_4_LAYERS, **variant)
    assert row.status == "exact", row


def test_heterogeneous_configs_give_each_layer_its_own_cache_shape():
    """transformers 5's per-layer configs raise on the global head_dim; the cache reads each layer's."""
    ids = TokenIds(vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = tiny_config(
        "gemma4_text", ids, **GEMMA_4_LAYERS, attention_k_eq_v=True, num_global_key_value_heads=1
    )
    specs = kv_cache_specs(config, torch.float32)
    assert [(spec.head_dim, spec.num_kv_heads, spec.sliding_window) for spec in specs] == [
        (16, 2, 16),
        (32, 1, None),
    ] * 2


def test_an_encoder_decoder_is_refused_by_name():
    with pytest.raises(Refused, match="encoder-decoder"):
        tiny_config("bart", TokenIds(vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=2))


def test_sizes_are_set_only_where_the_config_takes_them():
    config = tiny_config("falcon", TokenIds(vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=2))
    assert config.hidden_size == 64 and config.num_hidden_layers == 2 and config.vocab_size == 100


def test_a_tiny_model_keeps_one_layer_of_every_kind():
    """Two layers of Gemma 3's five-sliding-one-full pattern would test no full-attention layer."""
    ids = TokenIds(vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = tiny_config("gemma3_text", ids)
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert len(config.layer_types) == config.num_hidden_layers


def test_attention_with_learned_sinks_gives_transformers_tokens_on_the_cpu(tmp_path):
    """gpt-oss's sinks take a share of every softmax: the CPU backend computes them (on other
    devices but a Gaudi too; there they are refused: test_attention_sinks.py)."""
    row = run_one("gpt_oss", "GptOssForCausalLM", tmp_path)
    assert row.status == "exact", row


@pytest.mark.parametrize(
    "model_type,reason",
    [
        ("mamba", "no attention heads"),
        ("minimax", "linear_attention"),
        ("lfm3", "conv"),
        ("bamba", "linear_attention"),
        ("dots3_note_text", "indexed_attention"),  # a heterogeneous config: its heads are per layer
        ("diffllama", "differential attention"),
    ],
)
def test_layers_that_keep_other_state_than_keys_and_values_are_named(model_type, reason):
    """The reason the fallback recomputes such a model (its start-up warning quotes it) names the layers."""
    from transformers import AutoConfig

    from tgserve.server.models.registry import check_not_a_draft_model, state_beside_keys_and_values

    config = AutoConfig.for_model(model_type)
    assert reason in state_beside_keys_and_values(config)
    check_not_a_draft_model(config, model_type)  # served, not refused


def test_a_setting_the_model_cannot_run_without_is_named_at_load(tmp_path):
    """X-MOD without a default language: transformers' first forward would fail asking for
    set_default_language; the load names the config setting instead."""
    from transformers import XmodConfig

    from tgserve.server.loading.errors import ModelLoadError
    from tgserve.server.models.registry import check_required_settings

    with pytest.raises(ModelLoadError, match="needs 'default_language' in its config.json"):
        check_required_settings(XmodConfig(), "XmodForCausalLM")
    check_required_settings(XmodConfig(default_language="en_XX"), "XmodForCausalLM")


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "falcon", "qwen3"])
def test_attention_models_keep_only_keys_and_values(model_type):
    from transformers import AutoConfig

    from tgserve.server.models.registry import state_beside_keys_and_values

    assert state_beside_keys_and_values(AutoConfig.for_model(model_type)) is None


@pytest.mark.parametrize(
    "model_type,architecture",
    [
        ("moshi", "MoshiForCausalLM"),  # its config's sliding window is one transformers never applies
        ("megatron-bert", "MegatronBertForCausalLM"),  # a BERT-style config, set up as the decoder
    ],
)
def test_families_the_sweep_found_differing_now_give_transformers_tokens(tmp_path, model_type, architecture):
    row = run_one(model_type, architecture, tmp_path)
    assert row.status == "exact", row


@pytest.mark.parametrize(
    "model_type,architecture",
    [
        ("dbrx", "DbrxForCausalLM"),  # its attention and expert configs, which the size names miss
        ("roc_bert", "RoCBertForCausalLM"),  # glyph-shape and pronunciation embeddings set small too
        ("xmod", "XmodForCausalLM"),  # a default language for its adapters
        ("inkling2_text", "Inkling2ForCausalLM"),  # sliding layers' own heads; an unpadded LM head
    ],
)
def test_configs_the_size_names_missed_are_built_tiny_and_give_transformers_tokens(
    tmp_path, model_type, architecture
):
    row = run_one(model_type, architecture, tmp_path)
    assert row.status == "exact", row


def test_a_draft_model_is_refused_by_name(tmp_path):
    """Gemma 4's assistant attends over its target model's keys and values (its default config does
    not even build at tiny sizes): refused as what it is."""
    row = run_one("gemma4_assistant", "Gemma4AssistantForCausalLM", tmp_path)
    assert row.status == "refused" and "draft model" in row.detail, row


def test_differential_attention_is_recomputed_and_gives_transformers_tokens(tmp_path):
    """Two softmaxes a layer over one set of keys and two of values: its own attention, recomputed."""
    row = run_one("diffllama", "DiffLlamaForCausalLM", tmp_path)
    assert row.status == "exact", row


def test_alibi_biases_each_sequence_from_its_own_positions(tmp_path):
    """BLOOM through the fallback with three prompts of different lengths batched together (their
    contexts packed into one attention call): each gets the tokens transformers gives it alone."""
    import shutil

    import torch
    import transformers

    from tgserve import LLM, SamplingParams
    from tgserve.server.testing.fixtures import _token_ids, _tokenizer_dir, default_cache_dir

    tokenizer_dir = _tokenizer_dir(default_cache_dir())
    config = tiny_config("bloom", _token_ids(tokenizer_dir))
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).float().eval()
    model.save_pretrained(tmp_path)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    prompts = [list(range(5, 22)), [5, 6, 7, 8, 30, 31], list(range(40, 75))]
    want = [
        model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       pad_token_id=config.pad_token_id)[0, len(p):].tolist()
        for p in prompts
    ]  # fmt: skip
    llm = LLM(
        str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=64, block_size=8, num_blocks=64
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    assert [out.token_ids for out in llm.generate(prompts, params)] == want


@pytest.mark.parametrize("model_type", ["llama", "opt", "qwen3_moe"])
def test_dummy_weights_serve_any_architecture_from_its_config_alone(tmp_path, model_type):
    """load_format "dummy": no checkpoint in the directory, native or through transformers."""
    from tgserve import LLM, SamplingParams
    from tgserve.server.testing.arch_sweep import copy_tokenizer
    from tgserve.server.testing.fixtures import _token_ids, _tokenizer_dir, default_cache_dir

    tokenizer_dir = _tokenizer_dir(default_cache_dir())
    tiny_config(model_type, _token_ids(tokenizer_dir)).save_pretrained(tmp_path)
    copy_tokenizer(tokenizer_dir, tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", device="cpu", block_size=8, num_blocks=32)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7, 8]], params)[0].token_ids) == 4


def test_layers_that_reuse_earlier_layers_keys_and_values_share_their_cache(tmp_path):
    """Gemma 4's last layers attend over the keys and values of the last earlier layer of their
    kind (`kv_sharing_modes`): their cache is that layer's tensors (they store the same rows again),
    so a token's KV bytes are those of the layers that compute their own; tokens as transformers'."""
    from tgserve.server.engine.llm import LLM
    from tgserve.server.kv_cache.spec import kv_bytes_per_token

    sharing = dict(
        **GEMMA_4_LAYERS, num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1
    )
    row = run_one("gemma4_text", "Gemma4ForCausalLM", tmp_path, **sharing)
    assert row.status == "exact", row
    llm = LLM(str(tmp_path / "gemma4_text"), dtype="float32", device="cpu", num_blocks=16, block_size=8)
    shard = llm.engine.shard
    assert [spec.reads_kv_of for spec in shard.specs] == [None, None, 0, 1]
    caches = shard.forward.kv_caches
    assert caches[2] is caches[0] and caches[3] is caches[1]
    own = kv_bytes_per_token(shard.specs[:2], 8)
    assert kv_bytes_per_token(shard.specs, 8) == own == 2 * 4 * (2 * 16 + 1 * 32)
