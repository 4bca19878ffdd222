"""`--quantize fp8` and checkpoints that come quantized: what loads, what is refused, and how."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tgserve import LLM, SamplingParams
from tgserve.kernels.fp8_format import FP8
from tgserve.server.loading.errors import ModelLoadError
from tgserve.server.loading.quantization import checkpoint_quantization
from tgserve.server.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from tgserve.server.testing.agreement import (
    TOPICS,
    chat_prompts,
    count_agreeing,
    engine_forced_picks,
    engine_greedy,
)
from tgserve.server.testing.fixtures import fixture_path, write_fp8_checkpoint
from tgserve.server.testing.smollm2 import smollm2_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _marked_quantized(arch: str, tmp_path: Path, quantization: dict) -> Path:
    """A copy of a fixture whose config says its weights were quantized by another tool."""
    target = tmp_path / arch
    shutil.copytree(fixture_path(arch), target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("arch", ["llama", "mixtral"])  # native, and through transformers
@pytest.mark.parametrize("method", ["awq", "fp8", "compressed-tensors"])
def test_checkpoints_quantized_otherwise_are_refused_by_name(arch: str, method: str, tmp_path: Path) -> None:
    # Before this check, the transformers path loaded an fp8 checkpoint's weights as plain ones
    # without a word, and answered with noise. fp8 here is transformers' block-scaled layout,
    # compressed-tensors an int4 one.
    quantization = {
        "quant_method": method,
        "bits": 4,
        "weight_block_size": [128, 128],
        "format": "pack-quantized",
    }
    model = _marked_quantized(arch, tmp_path, quantization)
    with pytest.raises(ModelLoadError, match=f"{method}-quantized checkpoint in a form.*--quantize fp8"):
        LLM(str(model), num_blocks=16)


@pytest.mark.parametrize("arch", ["llama", "phi3"])  # Phi-3's checkpoint fuses qkv and gate/up
def test_an_fp8_checkpoint_loads_its_rows_and_scales_as_they_are(arch: str, tmp_path: Path) -> None:
    """Per-row scales: the checkpoint holds what --quantize fp8 computes from the unquantized
    fixture, so the two engines hold the same fp8 weights and give the same log-probabilities."""
    checkpoint = LLM(
        str(write_fp8_checkpoint(fixture_path(arch), tmp_path / "fp8", "channel")), num_blocks=32
    )
    quantized = LLM(str(fixture_path(arch)), quantize="fp8", num_blocks=32)
    mine, theirs = (
        dict(llm.engine.runner.forward.model.named_parameters()) for llm in (checkpoint, quantized)
    )
    qkv = "model.layers.1.self_attn.qkv_proj"
    assert mine[f"{qkv}.weight"].dtype == FP8
    assert torch.equal(mine[f"{qkv}.weight"].view(torch.uint8), theirs[f"{qkv}.weight"].view(torch.uint8))
    assert torch.equal(
        mine[f"{qkv}.weight_scale"], quantized.engine.runner.forward.model.get_buffer(f"{qkv}.weight_scale")
    )
    text = "Once upon a time there was a little dog"
    ask = SamplingParams(temperature=0.0, max_new_tokens=4, prompt_logprobs=0, ignore_eos=True)
    a, b = (llm.generate([text], ask)[0] for llm in (checkpoint, quantized))
    assert [t.logprob for t in a.prompt_logprobs[1:]] == [t.logprob for t in b.prompt_logprobs[1:]]
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("layout", ["compressed-tensors", "autofp8"])
def test_an_fp8_checkpoint_with_a_scale_per_tensor_repeats_it_for_each_row(
    layout: str, tmp_path: Path
) -> None:
    # Phi-3's checkpoint has one scale for its fused qkv_proj: each of q, k and v takes it.
    phi3 = LLM(
        str(write_fp8_checkpoint(fixture_path("phi3"), tmp_path / "phi3-fp8", "tensor", layout)),
        num_blocks=32,
    )
    fused = phi3.engine.runner.forward.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight_scale")
    assert (fused == fused[0]).all() and len(phi3.generate(["Once upon a time"], GREEDY)[0].token_ids) == 8
    checkpoint = write_fp8_checkpoint(fixture_path("llama"), tmp_path / "fp8", "tensor", layout)
    llm = LLM(str(checkpoint), num_blocks=32)
    scales = llm.engine.runner.forward.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight_scale")
    config = json.loads((fixture_path("llama") / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    q, k, v = scales.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    for part in (q, k, v):
        assert (part == part[0]).all()  # one scale a part (a tensor of the checkpoint)
    assert len({q[0].item(), k[0].item(), v[0].item()}) == 3
    assert len(llm.generate(["Once upon a time"], GREEDY)[0].token_ids) == 8


def test_fp8_checkpoints_need_the_native_path_and_fp8_projections(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="fp8 checkpoints load natively"):
        LLM(
            str(write_fp8_checkpoint(fixture_path("gpt_neox"), tmp_path / "neox-fp8", "channel")),
            num_blocks=16,
        )
    mixed = write_fp8_checkpoint(fixture_path("llama"), tmp_path / "fp8", "channel")
    (file,) = mixed.glob("*.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].float() * tensors[name.replace(".weight", ".weight_scale")]
    save_file(tensors, file)
    with pytest.raises(ModelLoadError, match="projection weight is torch.float32, not torch.float8_e4m3fn"):
        LLM(str(mixed), num_blocks=16)


def test_a_quantization_config_is_read_from_dicts_and_config_objects() -> None:
    class Config:
        def to_dict(self) -> dict:
            return {"quant_method": "gptq"}

    assert checkpoint_quantization(type("C", (), {"quantization_config": {"quant_method": "awq"}})) == "awq"
    assert checkpoint_quantization(type("C", (), {"quantization_config": Config()})) == "gptq"
    assert checkpoint_quantization(type("C", (), {})) is None


def test_unknown_quantize_methods_and_the_transformers_path_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="--quantize must be one of fp8; got 'awq'"):
        LLM(str(fixture_path("llama")), quantize="awq", num_blocks=16)
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM runs through transformers"):
        LLM(str(fixture_path("gpt_neox")), quantize="fp8", num_blocks=16)


def test_fp8_layers_hold_fp8_rows_and_compute_close_to_the_full_product() -> None:
    torch.manual_seed(0)
    column = ColumnParallelLinear(64, [32, 16, 16], bias=True)
    row = RowParallelLinear(64, 48, bias=False)
    x = torch.randn(5, 64)
    for layer in (column, row):
        torch.nn.init.normal_(layer.weight, std=0.05)
        if layer.bias is not None:
            torch.nn.init.normal_(layer.bias)
        exact = F.linear(x, layer.weight, layer.bias)
        layer.quantize_fp8_()
        assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (layer.weight.shape[0], 1)
        got = layer(x)
        assert got.dtype == x.dtype
        # e4m3 keeps 3 mantissa bits on both operands: a few percent of the output's scale.
        assert (got - exact).abs().max() <= 0.05 * exact.abs().max()


def test_fp8_refuses_projection_sizes_its_products_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiples of 16; this one is 24 x 64"):
        ColumnParallelLinear(64, [24], bias=False).quantize_fp8_()


def test_fp8_engine_stores_projections_in_fp8_and_generates() -> None:
    plain = LLM(str(fixture_path("llama")), num_blocks=32)
    fp8 = LLM(str(fixture_path("llama")), quantize="fp8", num_blocks=32)
    model = fp8.engine.runner.forward.model
    kinds = {name: p.dtype for name, p in model.named_parameters()}
    assert {kinds[n] for n in kinds if n.endswith("proj.weight")} == {FP8}
    assert kinds["model.embed_tokens.weight"] == kinds["model.norm.weight"] != FP8  # these stay put
    out = fp8.generate(["Once upon a time"], GREEDY)[0]
    assert len(out.token_ids) == 8
    # The random fixture's logits are too flat for fp8 to keep every greedy pick; it must still
    # compute the same function: the prompt's log-probabilities follow the unquantized model's.
    # (Measured: fp8 differs by 0.18 nats on average, correlation 0.980; bf16 by 0.014, 0.9999.
    # Without the weight scales the correlation would be noise.)
    text = "Once upon a time there was a little dog who lived in a house by the sea"
    ask = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    exact, close = (
        torch.tensor([t.logprob for t in llm.generate([text], ask)[0].prompt_logprobs[1:]])
        for llm in (plain, fp8)
    )
    assert (close - exact).abs().mean() <= 0.3
    assert torch.corrcoef(torch.stack([exact, close]))[0, 1] >= 0.95


@pytest.mark.slow
def test_fp8_smollm2_keeps_nine_greedy_steps_in_ten() -> None:
    """SmolLM2-135M-Instruct in fp8 against itself unquantized, teacher-forced over 8 chat prompts x 32
    greedy steps. (Measured on CPU, 16 prompts: fp8 458/512, bf16 497/512. A product without its
    scales agrees on none.)"""
    # The GGUF's weights converted once (tests of the GGUF path read the file itself, tens of seconds)
    checkpoint = str(smollm2_checkpoint())
    plain = LLM(checkpoint, max_num_seqs=8)
    prompts = chat_prompts(plain.tokenizer, TOPICS[:8])
    tokens = engine_greedy(plain.engine, prompts, 32)
    del plain
    fp8 = LLM(checkpoint, quantize="fp8", max_num_seqs=8)
    agree = count_agreeing(engine_forced_picks(fp8.engine, prompts, tokens), tokens)
    print(f"fp8 SmolLM2: {agree}/256 greedy steps agree with the unquantized model")
    assert agree >= 0.85 * 256


def test_an_fp8_mixture_of_experts_keeps_its_experts_dequantized(tmp_path: Path) -> None:
    """llm-compressor quantizes every expert's projections too: each loads as e4m3 times its row
    scale, in the model's dtype, beside fp8 attention projections."""
    from tgserve.server.testing.arch_sweep import saved_tiny_model

    saved_tiny_model(
        "qwen3_moe", "Qwen3MoeForCausalLM", tmp_path / "moe", num_experts=4, num_experts_per_tok=2
    )
    checkpoint = write_fp8_checkpoint(tmp_path / "moe", tmp_path / "moe-fp8", "channel")
    (file,) = checkpoint.glob("*.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn
    llm = LLM(str(checkpoint), num_blocks=32)
    model = llm.engine.runner.forward.model
    experts = model.model.layers[1].mlp.experts
    want = tensors[name].float() * tensors[name.replace(".weight", ".weight_scale")].float().reshape(-1, 1)
    assert torch.equal(experts.w_gate_up[3, experts.intermediate :], want)
    assert model.get_parameter("model.layers.0.self_attn.qkv_proj.weight").dtype == torch.float8_e4m3fn
    assert len(llm.generate(["Once upon a time"], GREEDY)[0].token_ids) == 8
