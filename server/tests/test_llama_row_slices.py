"""A long step's token-wise parts (projections, query/key norms, rotary, MLP) run a slice of rows at a
time, for bounded memory, and give the rows, the tokens and the log-probabilities of the whole step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.models import llama
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.fixtures import fixture_path


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_rows_in_slices_match_rows_at_once(act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimpleNamespace(
        model_type="llama", hidden_size=32, intermediate_size=48, hidden_act=act, mlp_bias=False
    )
    torch.manual_seed(0)
    mlp = llama.LlamaMLP(config)
    for param in mlp.parameters():
        param.data.normal_(0, 0.2)
    x = torch.randn(30, 32)
    at_once = mlp(x)
    monkeypatch.setattr(llama, "ROWS_AT_ONCE", 7)  # 30 rows: four slices of 7 and one of 2
    sliced = mlp(x)
    torch.testing.assert_close(sliced, at_once, rtol=1e-5, atol=1e-6)
    assert sliced.shape == (30, 32)


def serve(arch: str, prompts: dict[str, list[int]], **limits) -> dict[str, tuple[list[int], list]]:
    """Greedy tokens and prompt log-probabilities of each prompt, all served together on the CPU."""
    engine = LLMEngine(EngineArgs(model=str(fixture_path(arch)), device="cpu", dtype="float32", **limits))
    ask = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, prompt_logprobs=0)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, ask)
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    scores: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.prompt_logprobs is not None:
                scores[out.request_id] = [None if lp is None else lp.logprob for lp in out.prompt_logprobs]
    return {r: (tokens[r], scores[r]) for r in prompts}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, QKV bias, query/key norms
def test_a_step_in_row_slices_gives_the_tokens_of_the_whole_step(arch: str, monkeypatch) -> None:
    """Steps of up to 64 tokens (two whole prompts, then a third prompt's chunks beside their decode
    rows) with the token-wise parts in slices of 5 rows: the same greedy tokens, and the prompt
    log-probabilities of every row, as the whole step at once."""
    prompts = {"a": list(range(20, 71)), "b": list(range(200, 212)), "c": list(range(20, 60)) + [7, 8, 9]}
    limits = dict(block_size=8, num_blocks=64, max_num_batched_tokens=64)
    whole = serve(arch, prompts, **limits)
    monkeypatch.setattr(llama, "ROWS_AT_ONCE", 5)
    sliced = serve(arch, prompts, **limits)
    for request_id, (tokens, scores) in whole.items():
        assert sliced[request_id][0] == tokens
        torch.testing.assert_close(sliced[request_id][1][1:], scores[1:], rtol=1e-5, atol=1e-5)
