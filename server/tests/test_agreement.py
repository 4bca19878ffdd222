"""The greedy-step agreement measure (tgserve.server.testing.agreement) on CPU, in float32, where
the engine and transformers agree exactly: both ways of asking transformers must reproduce every
engine step, or the measure itself is misaligned (an off-by-one position, the padding, the cache).
The CUDA test holds the engine's bf16 tokens to the same measure."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tgserve.server.engine import EngineArgs, LLMEngine
from tgserve.server.hf_compat import dtype_kwargs
from tgserve.server.testing.agreement import (
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
