"""The transformers fallback's rotary embedding on tgserve's fused kernel
(server/models/fallback_rotary.py): the functions the kernel matches are taken, in the form each
returns (OLMo-2 casts float32 products back, Llama keeps them); an interleaved rotary keeps its own;
the kernel runs only inside the engine's forward and for its shapes, and gives the function's
numbers."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GlmConfig, LlamaConfig, Olmo2Config

from tgserve.kernels import dispatch
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.models.fallback_rotary import (
    _replacement,
    kernel_forms,
    kernel_rotary,
    swap_in_kernel_rotary,
)

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=100, pad_token_id=0, bos_token_id=0, eos_token_id=1,
)  # fmt: skip


def _modeling_module(config_class, dtype):
    model = AutoModelForCausalLM.from_config(config_class(**TINY), **dtype_kwargs(dtype))
    return model, sys.modules[type(model).__module__]


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the fused kernel's entry point ran."""
    calls = []
    rotary = dispatch.rotary

    def counting(*args, **kwargs):
        calls.append(1)
        return rotary(*args, **kwargs)

    monkeypatch.setattr(dispatch, "rotary", counting)
    return calls


def _rope_inputs(tokens: int, dtype: torch.dtype, cos_dtype: torch.dtype, batch: int = 1):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, tokens, 4, 16, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, tokens, 2, 16, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(batch, tokens, 8, generator=gen) * 1000
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, angles.cos().to(cos_dtype), angles.sin().to(cos_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_form_is_found_and_the_swapped_function_gives_the_same_numbers(dtype, kernel_calls):
    for config_class, casts_back in ((Olmo2Config, True), (LlamaConfig, False)):
        model, module = _modeling_module(config_class, dtype)
        original = getattr(module.apply_rotary_pos_emb, "tgserve_original", module.apply_rotary_pos_emb)
        forms = kernel_forms(original, dtype, torch.device("cpu"))
        assert forms[(dtype, dtype)] is True  # (in the model's dtype both forms are one)
        if dtype != torch.float32:
            assert forms[(dtype, torch.float32)] is casts_back, config_class.__name__
        assert swap_in_kernel_rotary(model, dtype) == 1
        swapped = module.apply_rotary_pos_emb
        for cos_dtype in (dtype, torch.float32):
            inputs = _rope_inputs(9, dtype, cos_dtype)
            want = original(*inputs)
            before = len(kernel_calls)
            with kernel_rotary():
                got = swapped(*inputs)
            assert len(kernel_calls) == before + 1
            assert all(w.dtype == g.dtype and torch.equal(w, g) for w, g in zip(want, got, strict=True))


def test_outside_the_engine_and_for_other_shapes_transformers_function_runs(kernel_calls):
    model, module = _modeling_module(LlamaConfig, torch.float32)
    assert swap_in_kernel_rotary(model, torch.float32) == 1
    swapped = module.apply_rotary_pos_emb
    swapped(*_rope_inputs(5, torch.float32, torch.float32))  # no engine forward around it
    with kernel_rotary():
        swapped(*_rope_inputs(5, torch.float32, torch.float32, batch=2))  # two sequences
        q, k, cos, sin = _rope_inputs(5, torch.float32, torch.float32)
        swapped(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)  # another layout
        swapped(*_rope_inputs(5, torch.float64, torch.float64))  # a dtype no probe approved
    assert kernel_calls == []


def test_a_call_by_keyword_without_keys_runs_transformers_function(kernel_calls):
    """Qwen4-Exp's rotary takes `k=None` and is called `q, cos=..., sin=...` for queries alone."""

    def queries_or_both(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
        def rotate(x):
            half = torch.cat([-x[..., 8:], x[..., :8]], -1)
            return x * cos.unsqueeze(unsqueeze_dim) + half * sin.unsqueeze(unsqueeze_dim)

        return rotate(q) if k is None else (rotate(q), rotate(k))

    swapped = _replacement(queries_or_both)
    q, k, cos, sin = _rope_inputs(5, torch.float32, torch.float32)
    swapped.tgserve_approved[(torch.float32, torch.float32)] = False
    with kernel_rotary():
        assert torch.equal(swapped(q, cos=cos, sin=sin), queries_or_both(q, cos=cos, sin=sin))
        assert kernel_calls == []
        swapped(q, k, cos, sin)  # the engine's form still takes the kernel
    assert len(kernel_calls) == 1


def test_an_interleaved_rotary_keeps_its_own_function():
    model, module = _modeling_module(GlmConfig, torch.float32)
    before = module.apply_rotary_pos_emb
    assert swap_in_kernel_rotary(model, torch.float32) == 0
    assert module.apply_rotary_pos_emb is before
    assert not kernel_forms(before, torch.float32, torch.device("cpu"))


def test_the_fallback_engine_takes_the_kernel(tmp_path, kernel_calls):
    """OLMo-2 through the engine's transformers fallback: transformers' greedy tokens, its rotary
    through the kernel's entry point at every layer of every step."""
    from tgserve.server.testing.arch_sweep import run_one

    row = run_one("olmo2", "Olmo2ForCausalLM", tmp_path)
    assert row.status == "exact", row
    assert kernel_calls, "the engine's forward never took the fused rotary"
