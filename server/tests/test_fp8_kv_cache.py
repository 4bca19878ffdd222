"""The 8-bit KV caches (--kv-cache-dtype fp8, int8) in the engine: what a token costs, what the pool
holds, how its names are checked, and how often SmolLM2's greedy steps agree with the full-precision
cache.
The kernels against their twins are in kernels/tests/test_fp8_kv.py; the cpu backend's steps over
an fp8 cache in test_cpu_attention.py; preemption, aborts and prefix hits over it in
test_async_engine.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import INT8
from tgserve.router.serve_args import KV_CACHE_DTYPE_NAMES
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.kv_cache.spec import KV_CACHE_DTYPES, KVCacheSpec, kv_cache_dtype
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.testing.agreement import (
    TOPICS,
    chat_prompts,
    count_agreeing,
    engine_greedy,
    logit_gaps,
    whole_sequence_logits,
)
from tgserve.server.testing.fixtures import fixture_path
from tgserve.server.testing.smollm2 import smollm2_checkpoint


def test_an_fp8_token_costs_a_byte_an_element_and_a_scale_a_row() -> None:
    # Llama-3-8B's layer: 8 KV heads of 128. bf16: 4 KiB a token a layer; fp8: 2 KiB and 64 bytes.
    assert KVCacheSpec(8, 128, torch.bfloat16).bytes_per_token() == 4096
    assert KVCacheSpec(8, 128, FP8).bytes_per_token() == 2 * 8 * (128 + 4)
    assert KVCacheSpec(8, 128, FP8).scaled and not KVCacheSpec(8, 128, torch.bfloat16).scaled
    assert (
        KVCacheSpec(8, 128, INT8).bytes_per_token() == 2 * 8 * (128 + 4) and KVCacheSpec(8, 128, INT8).scaled
    )


def test_the_router_and_the_engine_know_the_same_names() -> None:
    assert set(KV_CACHE_DTYPE_NAMES) == set(KV_CACHE_DTYPES)
    assert (
        kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
        and kv_cache_dtype("fp8", torch.float32) == FP8
        and kv_cache_dtype("int8", torch.bfloat16) == INT8
    )
    with pytest.raises(ValueError, match="'int4' is not one of: auto, fp8"):
        kv_cache_dtype("int4", torch.bfloat16)


def test_an_unknown_name_fails_before_the_weights_load() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp16'"):
        LLMEngine(EngineArgs(model=str(fixture_path("llama")), device="cpu", kv_cache_dtype="fp16"))


def test_a_prompt_past_the_pool_is_refused_naming_the_cache_dtype() -> None:
    from tgserve.server.protocol.params import InvalidRequestError, SamplingParams

    engine = LLMEngine(EngineArgs(model=str(fixture_path("llama")), device="cpu", dtype="float32",
                                  kv_cache_dtype="fp8", num_blocks=2, block_size=8))  # fmt: skip
    assert engine.kv_cache_dtype_name == "float8_e4m3fn"
    with pytest.raises(InvalidRequestError, match=r"holds at most 16 tokens \(float8_e4m3fn"):
        engine.add_request("long", list(range(5, 25)), SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize("eight_bits,stored", [("fp8", FP8), ("int8", INT8)])
@pytest.mark.parametrize("tail", [False, True])
def test_the_same_memory_holds_twice_the_tokens_less_the_scales(eight_bits, stored, tail) -> None:
    """A bf16 model: 2 bytes an element against 1, plus 4 bytes a row of head_dim elements; with
    the tail, its slots (a bf16 block a running sequence) come out of the same memory first."""
    blocks = {}
    memory = 64 << 20
    for kv in ("auto", eight_bits):
        args = EngineArgs(model=str(fixture_path("llama")), device="cpu", dtype="bfloat16", kv_cache_dtype=kv,
                          kv_cache_memory_bytes=memory, block_size=8, kv_cache_tail=tail)  # fmt: skip
        engine = LLMEngine(args)
        blocks[kv] = engine.num_blocks
        spec = engine.shard.specs[0]
        assert (
            engine.shard.forward.kv_caches[0].dtype
            == spec.dtype
            == (stored if kv == eight_bits else torch.bfloat16)
        )
    ratio = 2 * spec.head_dim / (spec.head_dim + 4)
    layers = len(engine.shard.specs)
    tail_bytes = args.max_num_seqs * 2 * 8 * spec.num_kv_heads * spec.head_dim * 2 * layers if tail else 0
    assert engine.shard.tail_bytes == tail_bytes
    assert (engine.shard.forward.tails is not None) == tail
    assert blocks[eight_bits] == pytest.approx(blocks["auto"] * ratio * (1 - tail_bytes / memory), rel=1e-3)


# The 32 agreement prompts x 32 greedy steps of SmolLM2-135M-Instruct in float32 on CPU, so the
# only difference from transformers is the cache. Measured (torch 2.13, transformers 5.x), with the
# full-precision tail (each sequence's current block kept in the model's dtype,
# kv_cache/tail_blocks.py): fp8 1003/1024 steps agree, the largest gap where they part 0.40 logit
# units; int8 1013/1024, 0.15. Without the tail: fp8 989, int8 1007
# (docs/benchmarks/2026-12-06-kv-tail-agreement-cpu.md).
AGREEMENT_PROMPTS, AGREEMENT_STEPS = 32, 32
MIN_AGREEMENT = {"fp8": 0.97, "int8": 0.98}
NEAR_TIE_LOGITS = 1.0  # a flipped step lies this close to the top logit at most; a wrong cache parts by many


@pytest.mark.slow
@pytest.mark.parametrize("eight_bits", ["fp8", "int8"])
def test_8_bit_cache_agrees_with_the_full_precision_cache_on_smollm2(eight_bits) -> None:
    """The 8-bit-cache engine's greedy tokens, teacher-forced into transformers float32 (which the
    float32-cache engine reproduces exactly, test_agreement.py): every step where they part is a
    near-tie, and they part rarely."""
    path = smollm2_checkpoint()
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", device="cpu", max_num_seqs=AGREEMENT_PROMPTS,
                                  kv_cache_dtype=eight_bits))  # fmt: skip
    prompts = chat_prompts(engine.tokenizer, TOPICS[:AGREEMENT_PROMPTS])
    tokens = engine_greedy(engine, prompts, AGREEMENT_STEPS)
    del engine
    model = AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs(torch.float32)).eval()
    with torch.no_grad():
        logits = [whole_sequence_logits(model, p, t) for p, t in zip(prompts, tokens, strict=True)]
    picks = [rows.argmax(-1).tolist() for rows in logits]
    largest_gap = max(max(logit_gaps(rows, t)) for rows, t in zip(logits, tokens, strict=True))
    agree = count_agreeing(picks, tokens)
    steps = AGREEMENT_PROMPTS * AGREEMENT_STEPS
    print(f"{eight_bits} KV on CPU: {agree}/{steps} steps agree, largest gap {largest_gap:.3f}")
    assert largest_gap <= NEAR_TIE_LOGITS
    assert agree / steps >= MIN_AGREEMENT[eight_bits]


def test_the_ready_message_names_the_kv_dtype_and_the_longest_servable_context(tmp_path) -> None:
    """What the router's /info and its default limits read: a pool of 8 blocks of 8 holds 64 tokens."""
    from tgserve.server.engine.service import ready_message

    engine = LLMEngine(EngineArgs(model=str(fixture_path("llama")), device="cpu", dtype="float32",
                                  kv_cache_dtype="fp8", block_size=8, num_blocks=8))  # fmt: skip
    ready = ready_message(engine, str(tmp_path))
    assert (ready.kv_cache_dtype, ready.max_servable_tokens) == ("float8_e4m3fn", 64)
    assert ready.max_model_len > 64
