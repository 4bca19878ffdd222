"""Selective decode attention in the engine (--decode-attention-budget): where its key summaries are
kept, what they cost, how bad flags fail, and that a budget at least the context gives the dense
path's tokens on every fixture architecture. The kernels and the selection's accuracy on planted
attention are in kernels/tests/test_decode_selection.py; preemption, aborts and prefix hits with
selection on an fp8 cache in test_async_engine.py."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels.decode_selection import DecodeSelection
from tgserve.kernels.fp8_format import FP8
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.kv_cache.spec import KVCacheSpec, kv_bytes_per_token, with_key_summaries
from tgserve.server.testing.agreement import engine_greedy
from tgserve.server.testing.fixtures import FIXTURE_ARCHITECTURES, fixture_path

PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((45, 20, 61, 33))]


def _engine(arch: str, **options) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(fixture_path(arch)), device="cpu", dtype="float32", block_size=8,
                                max_num_batched_tokens=64, num_blocks=64, **options))  # fmt: skip


def test_a_summary_costs_two_keys_a_block_and_only_full_attention_layers_keep_one() -> None:
    # Llama-3-8B's layer in fp8: 16 tokens of 2 x 8 x (128 + 4) bytes, and a summary of 2 x 8 x 128 bf16.
    full, window = KVCacheSpec(8, 128, FP8), KVCacheSpec(8, 128, FP8, sliding_window=4096)
    specs = with_key_summaries([full, window], torch.bfloat16)
    assert [s.summary_bytes() for s in specs] == [4096, 0]
    assert specs[0].bytes_per_block(16) == 16 * 2 * 8 * 132 + 4096  # 1/8 more than the block's KV
    assert kv_bytes_per_token(specs, 16) == 2 * (2 * 8 * 132) + 4096 // 16


def test_summaries_exist_only_where_the_models_length_passes_the_threshold() -> None:
    engine = _engine("llama", decode_attention_budget=32, decode_attention_min_context=16)
    assert engine.shard.selection == DecodeSelection.for_budget(32, 16)
    assert all(s is not None and s.shape[1] == engine.shard.forward.kv_caches[0].shape[1]
               for s in engine.shard.forward.key_summaries)  # fmt: skip
    beyond = _engine("llama", decode_attention_budget=32, decode_attention_min_context=10**6)
    assert beyond.shard.selection is None and beyond.shard.forward.key_summaries == [None] * len(
        beyond.shard.specs
    )


def test_a_budget_that_leaves_nothing_to_choose_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"--decode-attention-budget 16 must be at least 24 tokens"):
        _engine("llama", decode_attention_budget=16, decode_attention_min_context=0)


@pytest.mark.parametrize("arch", FIXTURE_ARCHITECTURES)
def test_a_budget_at_least_the_context_gives_the_dense_tokens(arch: str) -> None:
    """Every decode step selects (threshold 0) and chooses every block: the same tokens, exactly."""
    dense = engine_greedy(_engine(arch, decode_attention_budget=0), PROMPTS, 24)
    selecting = _engine(arch, decode_attention_budget=128, decode_attention_min_context=0)
    if selecting.shard.selection is None:  # every layer a sliding window: nothing to select
        assert all(s.sliding_window is not None for s in selecting.shard.specs)
    assert engine_greedy(selecting, PROMPTS, 24) == dense


def test_a_small_budget_drops_blocks_and_still_decodes() -> None:
    """Past the threshold with 4 blocks of 8 to attend, the logits move (blocks were dropped)."""
    dense = engine_greedy(_engine("llama", decode_attention_budget=0), PROMPTS, 24)
    selected = engine_greedy(
        _engine("llama", decode_attention_budget=32, decode_attention_min_context=16), PROMPTS, 24
    )
    assert [len(t) for t in selected] == [24] * len(PROMPTS)
    assert selected != dense


def _step(
    contexts: list[int], q_lens: list[int], backend, seed: int = 0, last_rows: bool = False
) -> torch.Tensor:
    """One attention step of a full-attention layer with key summaries, earlier tokens stored (and
    folded into the summaries) as previous steps would have; this step's rows' output (with
    `last_rows`, each sequence's last row's only, as a model's last layer asks)."""
    from tgserve.kernels.reference import update_key_summaries, write_kv
    from tgserve.server.attention.backend import AttentionLayerParams
    from tgserve.server.testing.attention_steps import step_metadata

    gen = torch.Generator().manual_seed(seed)
    block_size, heads, kv_heads, dim = 8, 8, 2, 16
    tables, used = [], 0
    for n in contexts:
        tables.append(list(range(used, used + -(-n // block_size))))
        used += len(tables[-1])
    order = torch.randperm(used + 2, generator=gen)
    tables = [[int(order[b]) for b in t] for t in tables]
    cache = torch.zeros(2, used + 2, block_size, kv_heads, dim)
    summary = torch.zeros(2, used + 2, kv_heads, dim)
    queries, keys, values, slots = [], [], [], []
    for table, n, q_len in zip(tables, contexts, q_lens):
        k, v = torch.randn(2, n, kv_heads, dim, generator=gen)
        pos = torch.arange(n)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        write_kv(k[: n - q_len], v[: n - q_len], cache, slot[: n - q_len])
        update_key_summaries(k[: n - q_len], slot[: n - q_len], summary, block_size)
        queries.append(torch.randn(q_len, heads, dim, generator=gen))
        keys.append(k[n - q_len :]), values.append(v[n - q_len :]), slots.append(slot[n - q_len :])
    meta = step_metadata(tables, contexts, q_lens, torch.cat(slots), block_size)
    layer = AttentionLayerParams(KVCacheSpec(kv_heads, dim, torch.float32), dim**-0.5, key_summary=summary)
    inputs = (torch.cat(queries), torch.cat(keys), torch.cat(values), cache, backend.plan(meta), layer)
    if last_rows:
        return backend.forward_rows(*inputs, meta.query_start_loc[1:].long() - 1)
    return backend.forward(*inputs)


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [1, 1, 30, 1]], ids=["decode", "mixed"])
def test_the_cuda_path_selects_as_the_cpu_backend_in_decode_and_mixed_steps(q_lens: list[int]) -> None:
    """The cuda backend over CPU tensors runs its kernels' twins: the chosen blocks' compacted tables
    (decode kernel) against the cpu backend's mask over the gathered blocks. Sequences past 64
    tokens select 8 blocks of 8; a mixed step's decode rows select as in a step of decode alone."""
    from tgserve.server.attention.cpu import CpuAttentionBackend
    from tgserve.server.attention.cuda import CudaAttentionBackend

    selection = DecodeSelection(64, 64, sink=8, recent=16)
    contexts = [200, 150, 90, 40]
    cpu = _step(contexts, q_lens, CpuAttentionBackend(selection))
    cuda = _step(contexts, q_lens, CudaAttentionBackend(None, selection))
    torch.testing.assert_close(cuda, cpu, atol=1e-5, rtol=1e-5)
    dense = _step(contexts, q_lens, CpuAttentionBackend())
    decode_rows = [s for s, q in zip([0, 1, 2, 2 + q_lens[2]], q_lens) if q == 1]
    assert (cpu[decode_rows] - dense[decode_rows]).abs().amax() > 1e-3  # the long ones dropped blocks
    assert torch.equal(cpu[decode_rows[-1]], dense[decode_rows[-1]])  # 40 tokens: under the threshold
    # A model's last layer, which attends each sequence's last row only, selects the same way.
    last = [start + q - 1 for start, q in zip([0, 1, 2, 2 + q_lens[2]], q_lens)]
    cuda_last = _step(contexts, q_lens, CudaAttentionBackend(None, selection), last_rows=True)
    torch.testing.assert_close(cuda_last, cpu[last], atol=1e-5, rtol=1e-5)
