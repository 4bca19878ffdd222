"""Models whose layers keep state besides keys and values (Mamba, linear-attention hybrids) keep
transformers' cache of each sequence between steps (`kept_states.py`), found by the tokens it was
built from: one token's forward a step, as `generate` runs, and recomputation wherever the tokens
changed (chunked prompts, preemption, prefix hits)."""

from __future__ import annotations

import pytest
import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.models import recompute_fallback
from tgserve.server.models.generation_steps import continuation_error, continue_generation
from tgserve.server.models.kept_states import KeptStates, prefix_and_whole_keys, state_bytes, token_key
from tgserve.server.models.recompute_fallback import CONTINUATION_TOLERANCE
from tgserve.server.testing.arch_sweep import CHECKPOINT_SETTINGS, saved_tiny_model

from .parity import assert_scenario_parity, build_requests

PROMPT_LENGTHS = [40, 12, 70, 25, 9, 50, 33, 30]
# Chunked prefill (70 > 32), preemption (24 blocks of 8 tokens), prefix hits: test_parity's scenario.
TIGHT = dict(max_num_batched_tokens=32, block_size=8, num_blocks=24, dtype="float32", device="cpu")
STATEFUL = [
    ("mamba", "MambaForCausalLM"),  # state-space layers only
    ("qwen3_5_text", "Qwen3_5ForCausalLM"),  # gated DeltaNet beside attention layers
]


def _key(*ids: int):
    return token_key(torch.tensor(ids, dtype=torch.int64))


def test_a_kept_state_is_found_only_by_its_tokens_and_taken_once():
    kept = KeptStates(max_states=8, max_bytes=1 << 20)
    kept.keep(_key(1, 2, 3), "abc")
    kept.keep(_key(1, 2, 3), "abc again")  # the same tokens in two sequences: a state each
    assert kept.take(_key(1, 2)) is None and kept.take(_key(1, 2, 4)) is None
    assert {kept.take(_key(1, 2, 3)), kept.take(_key(1, 2, 3))} == {"abc", "abc again"}
    assert kept.take(_key(1, 2, 3)) is None
    assert (kept.hits, kept.misses, len(kept)) == (2, 3, 0)


def test_a_rows_two_keys_are_those_of_its_prefix_and_of_all_its_tokens():
    ids = torch.tensor([7, 3, 9, 4], dtype=torch.int64)
    assert prefix_and_whole_keys(ids) == (token_key(ids[:-1]), token_key(ids))
    assert token_key(ids[:-1]) != token_key(torch.tensor([7, 3, 8], dtype=torch.int64))


def test_kept_states_evict_the_oldest_past_their_count_or_bytes():
    by_count = KeptStates(max_states=2, max_bytes=1 << 20)
    for i in range(3):
        by_count.keep(_key(i), [torch.zeros(4)])
    assert by_count.take(_key(0)) is None and len(by_count) == 2
    by_bytes = KeptStates(max_states=8, max_bytes=100)  # room for six 16-byte states
    for i in range(8):
        by_bytes.keep(_key(i), [torch.zeros(4)])
    assert len(by_bytes) == 6 and by_bytes.bytes == 96 and by_bytes.take(_key(1)) is None
    by_bytes.keep(_key(9), [torch.zeros(64)])  # larger than the whole budget: not kept
    assert by_bytes.take(_key(9)) is None


def test_state_bytes_counts_each_storage_once_through_nested_caches():
    class Layer:
        def __init__(self, t: torch.Tensor) -> None:
            self.keys, self.values, self.conv = t, t[:2], torch.zeros(3, dtype=torch.float64)

    shared = torch.zeros(10)
    state = {"cache": type("Cache", (), {})(), "attention_mask": torch.ones(1, 5, dtype=torch.int64)}
    state["cache"].layers = [Layer(shared), Layer(torch.zeros(2))]
    assert state_bytes(state) == 40 + 24 + 8 + 24 + 40


@pytest.mark.parametrize("model_type,architecture", STATEFUL)
def test_stateful_models_continue_kept_states_through_chunks_preemption_and_prefix_hits(
    tmp_path, model_type, architecture
):
    hf_model = saved_tiny_model(model_type, architecture, tmp_path, **CHECKPOINT_SETTINGS.get(model_type, {}))
    engine = LLMEngine(EngineArgs(model=str(tmp_path), **TIGHT))
    kept = engine.shard.kept_states
    assert kept is not None and len(kept) == 0
    assert_scenario_parity(engine, hf_model, build_requests(engine.vocab_size, PROMPT_LENGTHS))
    # A first logits row of each request, and of each after preemption, recomputes; every other step
    # continues (8 requests, 4-20 new tokens each).
    assert kept.misses >= len(PROMPT_LENGTHS) and kept.hits >= 3 * kept.misses, (kept.hits, kept.misses)


def test_continuation_is_checked_against_the_uncached_forward(tmp_path):
    hf_model = saved_tiny_model("mamba", "MambaForCausalLM", tmp_path)

    def uncached(ids: torch.Tensor) -> torch.Tensor:
        return hf_model(ids[None], use_cache=False).logits[0, -1]

    assert continuation_error(hf_model, uncached, torch.device("cpu")) < 1e-4
    prepare = hf_model.prepare_inputs_for_generation

    def the_wrong_token(ids, **kwargs):  # a one-token step then continues from another token
        inputs = prepare(ids, **kwargs)
        if inputs["input_ids"].shape[1] == 1:
            inputs["input_ids"] = (inputs["input_ids"] + 1) % hf_model.config.vocab_size
        return inputs

    hf_model.prepare_inputs_for_generation = the_wrong_token
    assert continuation_error(hf_model, uncached, torch.device("cpu")) > CONTINUATION_TOLERANCE[torch.float32]


def test_a_model_whose_steps_do_not_continue_its_cache_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setattr(recompute_fallback, "continuation_error", lambda *args: 0.5)
    hf_model = saved_tiny_model("mamba", "MambaForCausalLM", tmp_path)
    engine = LLMEngine(EngineArgs(model=str(tmp_path), **TIGHT))
    assert engine.shard.kept_states is None
    assert_scenario_parity(engine, hf_model, build_requests(engine.vocab_size, PROMPT_LENGTHS))


def test_running_out_of_memory_drops_the_kept_states_and_recomputes(tmp_path, monkeypatch):
    calls = []

    def out_of_memory_on_the_fifth(*args):
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("the kept states took it")
        return continue_generation(*args)

    monkeypatch.setattr(recompute_fallback, "continue_generation", out_of_memory_on_the_fifth)
    hf_model = saved_tiny_model("mamba", "MambaForCausalLM", tmp_path)
    engine = LLMEngine(EngineArgs(model=str(tmp_path), **TIGHT))
    assert_scenario_parity(engine, hf_model, build_requests(engine.vocab_size, PROMPT_LENGTHS))
    assert len(calls) > 5 and engine.shard.kept_states.hits > 5
