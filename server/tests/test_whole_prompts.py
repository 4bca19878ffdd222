"""Long prompts on the cuda backend: prefilled whole, in a step of their own, so that sparse
attention sees every key of the prompt; the engine's wiring of the scheduler's rule, on CPU.

On CPU tensors the cuda backend's kernels fall back to their torch twins (sparse prefill included),
so the engine runs here exactly as on a GPU, kernels aside. A sparse config whose every head is
dense keeps the attention exact: the tokens must be those of the plain CPU engine, which chunks.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tgserve.kernels import dispatch
from tgserve.kernels.sparse.config import HeadPattern, SparseConfig
from tgserve.server.attention.cuda import CudaAttentionBackend
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine import model_shard
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.execution.memory import GIB, MemoryProfile
from tgserve.server.kv_cache.spec import kv_bytes_per_token
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.fixtures import fixture_path

WHOLE = 64
EXACT_SPARSE = SparseConfig(default=HeadPattern("dense"), min_seq_len=WHOLE, block=16, last_q=16)
LIMITS = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=8, num_blocks=64, max_model_len=256)


def engine(**overrides) -> LLMEngine:
    args = dict(model=str(fixture_path("llama")), device="cpu", dtype="float32", **LIMITS)
    return LLMEngine(EngineArgs(**{**args, **overrides}))


def serve(llm: LLMEngine, prompts: dict[str, list[int]], new_tokens: int = 4) -> tuple[dict, list[dict]]:
    """Every prompt's greedy tokens and every step's scheduled tokens per request. The first prompt
    arrives alone and decodes while the others arrive."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    steps: list[dict[str, int]] = []
    launch = llm.runner.launch
    llm.runner.launch = lambda out: steps.append(dict(out.num_scheduled_tokens)) or launch(out)
    for i, (rid, prompt) in enumerate(prompts.items()):
        llm.add_request(rid, list(prompt), params)
        if i == 0:
            for out in llm.step():
                outputs[out.request_id].extend(out.new_token_ids)
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return outputs, steps


def use_cuda_backend(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Engines built from here on take the cuda backend with EXACT_SPARSE in place of the cpu one;
    returns the lengths of the prompts that go through sparse attention (one entry per layer)."""
    monkeypatch.setattr(
        model_shard,
        "attention_backend",
        lambda device, sparse, selection: CudaAttentionBackend(EXACT_SPARSE, selection),
    )
    sparse_lengths: list[int] = []
    sparse_one = dispatch._sparse_one
    monkeypatch.setattr(
        dispatch,
        "_sparse_one",
        lambda q, *rest, **kw: sparse_lengths.append(len(q)) or sparse_one(q, *rest, **kw),
    )
    return sparse_lengths


def test_a_long_prompt_runs_whole_and_sparse_while_others_run(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = {"short": list(range(5, 25)), "long": list(range(30, 130)), "medium": list(range(200, 240))}
    expected, chunked = serve(engine(), prompts)
    sparse_lengths = use_cuda_backend(monkeypatch)
    llm = engine()
    assert llm.scheduler.config.whole_prompt_tokens == WHOLE
    got, steps = serve(llm, prompts)
    assert got == expected
    assert {"long": 100} in steps and all(
        step["long"] == 1 for step in steps if "long" in step and step != {"long": 100}
    )
    assert (
        max(step.get("medium", 0) for step in steps) <= LIMITS["max_num_batched_tokens"]
    )  # under WHOLE: chunked
    # Every layer but the last, which attends only the row its logit reads, as a decode query.
    assert sparse_lengths and sparse_lengths == [100] * (llm.config.num_hidden_layers - 1)
    assert max(sum(step.values()) for step in chunked) <= LIMITS["max_num_batched_tokens"]


def test_no_whole_prompts_without_sparse_prefill_or_with_static_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        model_shard,
        "attention_backend",
        lambda device, sparse, selection: CudaAttentionBackend(None, selection),
    )
    assert engine().scheduler.config.whole_prompt_tokens is None
    monkeypatch.setattr(
        model_shard,
        "attention_backend",
        lambda device, sparse, selection: CudaAttentionBackend(EXACT_SPARSE, selection),
    )
    assert engine(static_shapes=True).scheduler.config.whole_prompt_tokens is None
    assert (
        engine(max_model_len=WHOLE - 1).scheduler.config.whole_prompt_tokens is None
    )  # no prompt reaches it
    assert engine().scheduler.config.whole_prompt_tokens == WHOLE


def test_the_pool_is_sized_for_a_whole_prompt_or_long_prompts_are_chunked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a GPU the KV budget is the smaller of the token budget's step and a whole prompt of the
    model's length; where the whole prompt would leave less than one such request's KV, long
    prompts are chunked instead, and the log names the way out. The choice, on given profiles."""
    use_cuda_backend(monkeypatch)
    shard = engine().shard
    one_request = shard.max_model_len * kv_bytes_per_token(shard.specs, shard.args.block_size)

    def profile(kv_budget: int) -> MemoryProfile:
        return MemoryProfile(100 * GIB, GIB, GIB, 0, kv_budget)

    budget_step = shard.memory_profile = profile(50 * one_request)
    shard._profile_whole_prompt(profile(20 * one_request))
    assert shard.whole_prompt_tokens == WHOLE and shard.memory_profile.kv_budget_bytes == 20 * one_request
    shard.memory_profile = budget_step
    with caplog.at_level(logging.WARNING):
        shard._profile_whole_prompt(profile(one_request - 1))
    assert shard.whole_prompt_tokens is None and shard.memory_profile is budget_step
    assert f"prompts of {WHOLE} tokens or more are prefilled in chunks" in caplog.text
    assert "less than the" in caplog.text and "--max-total-tokens" in caplog.text
    assert "--gpu-memory-utilization" in caplog.text


def test_a_whole_prompt_step_that_runs_out_of_memory_keeps_long_prompts_chunked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole-prompt profiling step that does not fit at all (a context longer than the device's
    memory allows one step for): the engine still starts, with long prompts chunked, rather than
    failing on the profile."""
    use_cuda_backend(monkeypatch)
    shard = engine().shard

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 60.00 GiB")

    monkeypatch.setattr(model_shard, "profile_step", out_of_memory)
    assert shard._whole_prompt_step() is None
    with caplog.at_level(logging.WARNING):
        shard._profile_whole_prompt(None)
    assert shard.whole_prompt_tokens is None
    assert f"a whole {shard.max_model_len}-token prompt's step does not fit in GPU memory" in caplog.text


@pytest.mark.parametrize(
    "pool,whole", [({}, WHOLE), ({"num_blocks": 4096}, None), ({"kv_cache_memory_bytes": 1 << 30}, None)]
)
def test_on_a_gpu_a_given_pool_size_keeps_long_prompts_chunked(
    pool: dict, whole: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool sized by profiling measures a whole prompt's step beside it; a given size does not,
    and a whole 128K-token step could then run out of memory mid-serving: chunks instead, said so.
    The decision alone, for a CUDA device (no GPU needed to make it)."""
    shard = SimpleNamespace(
        backend=CudaAttentionBackend(EXACT_SPARSE),
        max_model_len=256,
        buckets=None,
        device=torch.device("cuda"),
        args=EngineArgs(**pool),
    )
    shard._profiles_gpu_memory = lambda: model_shard.ModelShard._profiles_gpu_memory(shard)
    with caplog.at_level(logging.WARNING):
        assert model_shard.ModelShard._whole_prompt_tokens(shard) == whole
    assert ("--max-batch-total-tokens" in caplog.text) == (whole is None)


def test_a_whole_prompt_in_row_slices_attends_over_its_normed_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole prompt's step in row slices: its sparse attention writes over the layer's normed
    input (no output tensor of its own) in every layer but the last, with the tokens unchanged."""
    from tgserve.server.models import llama

    prompts = {"short": list(range(5, 25)), "long": list(range(30, 130))}
    expected, _ = serve(engine(), prompts)
    use_cuda_backend(monkeypatch)
    monkeypatch.setattr(llama, "ROWS_AT_ONCE", 30)  # the 100-token step in four slices
    over_input = []
    attend = llama.paged_attention

    def spy(*args, out=None, **kwargs):
        result = attend(*args, out=out, **kwargs)
        if out is not None:
            over_input.append(result.data_ptr() == out.data_ptr())
        return result

    monkeypatch.setattr(llama, "paged_attention", spy)
    llm = engine()
    got, _ = serve(llm, prompts)
    assert got == expected
    assert over_input == [True] * (llm.config.num_hidden_layers - 1)
