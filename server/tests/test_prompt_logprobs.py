"""Prompt log-probabilities: equal to transformers' on the whole prompt, across chunked prefill,
preemption and a prompt already in the prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tgserve import LLM, SamplingParams
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.testing.fixtures import fixture_path

SCORED = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True, prompt_logprobs=2)


def reference_prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the distribution over prompt token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(entries: list, prompt: list[int], expected: torch.Tensor, top_n: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row = expected[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        top_values, top_ids = row.topk(top_n)
        assert [i for i, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def llama_on_cpu(**engine_args) -> LLM:
    """The engine on the CPU in fp32, like the reference: on a GPU machine "auto" would pick bf16."""
    return LLM(str(fixture_path("llama")), device="cpu", **engine_args)


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(fixture_path("llama"), **dtype_kwargs(torch.float32)).eval()


def test_prompt_logprobs_match_transformers_across_chunks_and_preemption(reference) -> None:
    # A 32-token budget splits the long prompts into chunks; 14 blocks of 8 cannot hold all four
    # requests at once, so some are preempted and recompute their prompts.
    llm = llama_on_cpu(max_num_batched_tokens=32, block_size=8, num_blocks=14)
    prompts = [list(range(5, 5 + n)) for n in (70, 9, 41, 2)]
    params = [SCORED, SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True), SCORED, SCORED]
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert outputs[1].prompt_logprobs is None
    for out, prompt in ((outputs[0], prompts[0]), (outputs[2], prompts[2]), (outputs[3], prompts[3])):
        assert_matches(out.prompt_logprobs, prompt, reference_prompt_logprobs(reference, prompt), top_n=2)


def test_a_cached_prompt_is_recomputed_for_its_logprobs(reference) -> None:
    llm = llama_on_cpu(max_num_batched_tokens=64, block_size=8, num_blocks=64)
    prompt = list(range(30, 70))
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2))[0]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2))[0]
    assert plain.num_cached_tokens == 0 and again.num_cached_tokens == 32  # whole blocks, one token left
    scored = llm.generate([prompt], SCORED)[0]
    assert scored.num_cached_tokens == 0
    assert_matches(scored.prompt_logprobs, prompt, reference_prompt_logprobs(reference, prompt), top_n=2)


def test_a_one_token_prompt_has_one_null_entry() -> None:
    llm = llama_on_cpu(max_num_batched_tokens=64, block_size=8, num_blocks=16)
    out = llm.generate([[7]], SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]


def test_last_layer_after_attention_runs_only_for_the_rows_logits_read() -> None:
    """A step that reads one logit row of a 40-token prompt runs the last layer's output projection
    and MLP on that row (the other layers on all 40), and its token and log-probabilities equal
    those of a step that reads every row (prompt log-probabilities on)."""
    llm = llama_on_cpu(max_num_batched_tokens=64, block_size=8, num_blocks=64, enable_prefix_caching=False)
    layers = llm.engine.runner.forward.model.model.layers
    rows = {"first": [], "last": [], "last o_proj": []}
    layers[0].mlp.register_forward_hook(lambda m, args, out: rows["first"].append(args[0].shape[0]))
    layers[-1].mlp.register_forward_hook(lambda m, args, out: rows["last"].append(args[0].shape[0]))
    layers[-1].self_attn.o_proj.register_forward_hook(
        lambda m, args, out: rows["last o_proj"].append(args[0].shape[0])
    )
    prompt = list(range(30, 70))
    pruned = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=1, logprobs=3))[0]
    assert rows == {"first": [40], "last": [1], "last o_proj": [1]}
    for seen in rows.values():
        seen.clear()
    every = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=1, logprobs=3, prompt_logprobs=1)
    )
    assert rows == {"first": [40], "last": [40], "last o_proj": [40]}
    got, want = pruned.logprobs[0], every[0].logprobs[0]
    assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert [i for i, _ in got.top] == [i for i, _ in want.top]
