"""The greedy-step agreement measure (tgserve.server.testing.agreement) on CPU, in float32, where
the engine and transformers agree exactly: both ways of asking transformers must reproduce every
engine step, or the measure itself is misaligned (an off-by-one position, the padding, the cache).
The engine's bf16 tokens are held to it here on CPU, and by the CUDA test on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.testing.agreement import (
    GAP_LIMIT_ULPS,
    TOPICS,
    chat_prompts,
    count_agreeing,
    decode_loop_picks,
    engine_greedy,
    gaps_in_ulps,
    summarise_gaps,
    whole_sequence_logits,
    whole_sequence_picks,
)
from tgserve.server.testing.smollm2 import smollm2_checkpoint

NEW_TOKENS = 8
# The bf16 test's prompts and steps: half the GPU acceptance's 32 prompts, its 32 steps. bf16 products
# run at a sixth of float32's rate on CPUs without bf16 instructions (AVX2 only: 10 GFLOP/s against
# 60), where the four passes over 32 x 32 took 5-7 minutes, 16 x 32 under 3.
BF16_PROMPTS, BF16_STEPS = 16, 32


@pytest.mark.slow
def test_both_measures_reproduce_float32_engine_steps_exactly() -> None:
    path = smollm2_checkpoint()
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", device="cpu", max_num_seqs=4))
    # Prompts of different lengths, so that the decode loop's batch is really left-padded.
    prompts = chat_prompts(engine.tokenizer, [TOPICS[0], "the history of the Roman empire", TOPICS[3]])
    assert len({len(p) for p in prompts}) > 1
    tokens = engine_greedy(engine, prompts, NEW_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs(torch.float32)).eval()

    whole = [whole_sequence_picks(model, p, t) for p, t in zip(prompts, tokens, strict=True)]
    assert count_agreeing(whole, tokens) == len(prompts) * NEW_TOKENS
    gaps = [gaps_in_ulps(whole_sequence_logits(model, p, t), t) for p, t in zip(prompts, tokens, strict=True)]
    assert all(g == 0 for row in gaps for g in row)
    assert decode_loop_picks(model, prompts, tokens) == tokens


@pytest.mark.slow
def test_bf16_engine_parts_from_transformers_no_more_than_transformers_from_itself() -> None:
    """bf16 on CPU (the engine's torch paths): the engine's greedy tokens, teacher-forced into
    transformers' bf16 decode loop over the left-padded batch (as `generate` runs it), must agree with
    it within one point of how well that loop agrees with itself run one prompt at a time, and on
    97% at least. Every step where the engine parts from transformers' whole-sequence forward must
    be a near-tie, within GAP_LIMIT_ULPS rounding steps of its largest logit. (Measured with torch
    2.13 and transformers 5.24, 32 prompts x 32 steps: the engine 1005/1024 against either loop,
    transformers batched against unbatched 995, largest gap 4 steps;
    docs/benchmarks/2026-11-30-pool-at-defaults-and-decode-probes-h200.md. On an AVX2-only CPU, 16 x
    32: the engine 502/512 against the batched loop, the loop against itself unbatched 502, largest
    gap 2 steps.)"""
    path = smollm2_checkpoint()
    engine = LLMEngine(EngineArgs(model=str(path), dtype="bfloat16", device="cpu", max_num_seqs=BF16_PROMPTS))
    prompts = chat_prompts(engine.tokenizer, TOPICS[:BF16_PROMPTS])
    tokens = engine_greedy(engine, prompts, BF16_STEPS)
    del engine
    model = AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs(torch.bfloat16)).eval()
    with torch.no_grad():
        batched = decode_loop_picks(model, prompts, tokens)
        one_by_one = [decode_loop_picks(model, [p], [t])[0] for p, t in zip(prompts, tokens, strict=True)]
        logits = [whole_sequence_logits(model, p, t) for p, t in zip(prompts, tokens, strict=True)]
    total = BF16_PROMPTS * BF16_STEPS
    engine_agree = count_agreeing(batched, tokens)
    itself = count_agreeing(one_by_one, batched)
    gaps = summarise_gaps(logits, tokens)
    print(
        f"bf16 on CPU: engine {engine_agree}/{total}, transformers batched vs one by one {itself}/{total}, {gaps}"
    )
    assert gaps["largest_gap_steps"] <= GAP_LIMIT_ULPS
    assert engine_agree / total >= max(0.97, itself / total - 0.01)


def test_agreement_counts_step_by_step() -> None:
    assert count_agreeing([[1, 2, 3], [4, 5]], [[1, 0, 3], [4, 5]]) == 4
    with pytest.raises(ValueError):
        count_agreeing([[1, 2]], [[1, 2, 3]])


def test_gaps_count_rounding_steps_below_the_largest_logit() -> None:
    # bf16 holds 16-32 in steps of 0.125 and 1-2 in steps of 2**-7.
    logits = torch.tensor([[16.0, 16.125, 3.0], [1.0, 1.5, 1.5], [-2.0, -1.0, -3.0]], dtype=torch.bfloat16)
    assert gaps_in_ulps(logits, [0, 2, 0]) == [1.0, 0.0, 128.0]
    assert gaps_in_ulps(logits[:1].float(), [0]) == [2.0**-3 / 2.0**-19]  # float32 steps at 16: 2**-19
    assert summarise_gaps([logits, logits[:1]], [[0, 2, 0], [1]]) == {
        "ties_largest": 2,
        "within_one_step": 3,
        "largest_gap_steps": 128.0,
    }
