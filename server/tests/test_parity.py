"""Token-exact greedy parity with transformers `generate`, in float32 on CPU.

For every fixture architecture and for SmolLM2-135M-Instruct: one engine run with staggered
arrivals and finishes, chunked prefill, at least one preemption and prefix-cache hits (parity.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.testing.fixtures import FIXTURE_ARCHITECTURES, fixture_path
from tgserve.server.testing.smollm2 import smollm2_checkpoint

from .parity import assert_scenario_parity, build_requests

PROMPT_LENGTHS = [40, 12, 70, 25, 9, 50, 33, 30]
# Small enough to force chunked prefill (70 > 32) and preemption (24 blocks of 8 tokens).
TIGHT = dict(max_num_batched_tokens=32, block_size=8, num_blocks=24)
FLOAT32 = dtype_kwargs(torch.float32)


def _run(model_path: str, hf_model: torch.nn.Module, **engine_args) -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=model_path, **TIGHT, **engine_args))
    assert_scenario_parity(engine, hf_model, build_requests(engine.vocab_size, PROMPT_LENGTHS))
    return engine


@pytest.mark.parametrize("arch", FIXTURE_ARCHITECTURES)
def test_greedy_parity_with_transformers(arch: str) -> None:
    path = fixture_path(arch)
    hf_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **FLOAT32)
    _run(str(path), hf_model)


@pytest.mark.parametrize("arch", ["llama", "gpt_bigcode"])
def test_native_architectures_also_run_through_the_fallback(arch: str) -> None:
    path = fixture_path(arch)
    hf_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **FLOAT32)
    engine = _run(str(path), hf_model, force_transformers_fallback=True)
    assert type(engine.runner.forward.model).__name__ == "TransformersFallbackModel"


def test_native_implementations_are_used_for_their_families() -> None:
    for arch, expected in [
        ("llama", "LlamaForCausalLM"),
        ("qwen3", "LlamaForCausalLM"),
        ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    ]:
        engine = LLMEngine(EngineArgs(model=str(fixture_path(arch)), num_blocks=8))
        assert type(engine.runner.forward.model).__name__ == expected


@pytest.mark.slow
def test_greedy_parity_smollm2() -> None:
    # The GGUF converted once to safetensors; test_llm_api.py covers loading the GGUF itself.
    path = smollm2_checkpoint()
    hf_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **FLOAT32)
    _run(str(path), hf_model)
