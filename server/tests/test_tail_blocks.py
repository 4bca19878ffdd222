"""An 8-bit cache's full-precision tail slots (`server/kv_cache/tail_blocks.py`): which block each
request's slot serves step by step, what a slot taken over a block with rows already stored holds,
and the engine over an fp8 cache with and without the tail."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import dequantize_kv
from tgserve.kernels.reference import write_kv
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.kv_cache.tail_blocks import TailBlocks
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.fixtures import fixture_path

BLOCK = 4


def _pool(num_blocks: int = 6, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, num_blocks, BLOCK, heads, dim, dtype=FP8), torch.zeros(2, num_blocks, heads, BLOCK)


def _map(tails: TailBlocks) -> dict[int, int]:
    return {block: int(slot) for block, slot in enumerate(tails.slot_of.tolist()) if slot >= 0}


def test_a_request_slot_follows_its_current_block_and_comes_back_when_it_ends() -> None:
    tails = TailBlocks([_pool()], slots=2, dtype=torch.float32)
    tails.plan_step([("a", 3, 0, 3), ("b", 1, 0, 2)])  # prompts of 3 and 2 tokens
    a, b = _map(tails)[3], _map(tails)[1]
    assert a != b
    tails.plan_step([("a", 3, 3, 4), ("b", 1, 2, 3)])  # a fills its block this step: still read from the slot
    assert _map(tails) == {3: a, 1: b}
    tails.plan_step([("a", 5, 0, 1), ("b", 1, 3, 4)])  # a moves on: the same slot, its new block
    assert _map(tails) == {5: a, 1: b}
    tails.release("a")
    assert _map(tails) == {1: b}
    tails.plan_step([("c", 2, 0, 1)])  # b not scheduled; its block is full: given up, its slot kept
    assert _map(tails) == {2: a}
    tails.plan_step([("d", 4, 0, 1)])  # no slot free (b keeps its own): d's block is read from the pool
    assert _map(tails) == {2: a}


def test_a_request_not_scheduled_keeps_its_partial_block() -> None:
    tails = TailBlocks([_pool()], slots=2, dtype=torch.float32)
    tails.plan_step([("a", 0, 0, 2)])
    tails.plan_step([("b", 1, 0, 1)])  # a waits this step: its block still partial, its slot kept
    assert _map(tails) == {0: _map(tails)[0], 1: _map(tails)[1]} and len(_map(tails)) == 2


def test_a_slot_taken_over_stored_rows_holds_them_as_the_pool_does() -> None:
    """A request resumed with its last block already stored (swapped in, a prefix hit on it): the
    rows before this step come from the pool, dequantized; the step's own rows are then written."""
    pool, scale = _pool()
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    write_kv(keys, values, pool, torch.tensor([8, 9, 10]), scale)  # block 2, rows 0-2
    tails = TailBlocks([(pool, scale)], slots=1, dtype=torch.float32)
    tails.plan_step([("a", 2, 3, 4)])
    slot = _map(tails)[2]
    for side, rows in enumerate((keys, values)):
        stored = dequantize_kv(pool[side, 2, :3], scale[side, 2, :, :3].T)
        assert torch.equal(tails.layers[0].cache[side, slot, :3], stored)
        assert not torch.equal(stored, rows)  # the pool's precision, not the rows as computed


def test_layers_that_share_a_cache_share_its_tail() -> None:
    first, second = _pool(), _pool()
    tails = TailBlocks([first, first, second], slots=3, dtype=torch.bfloat16)
    assert tails.layers[0] is tails.layers[1] and tails.layers[1] is not tails.layers[2]
    assert (
        tails.layers[2].cache.shape == (2, 3, BLOCK, 2, 8) and tails.layers[2].cache.dtype == torch.bfloat16
    )


def _engine(kv: str, tail: bool = True) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(fixture_path("llama")), device="cpu", dtype="float32", kv_cache_dtype=kv,
                                kv_cache_tail=tail, block_size=8, enable_prefix_caching=False))  # fmt: skip


def _greedy(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's greedy tokens and their log-probabilities, all submitted at once."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.new_logprobs or [])
    order = [str(i) for i in range(len(prompts))]
    return [tokens[i] for i in order], [logprobs[i] for i in order]


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_within_its_slotted_block_a_context_decodes_as_the_full_precision_cache(kv) -> None:
    """Prompt and output within one block of 8: with the tail, every decode step reads that block
    from its slot (the prompt's own step reads its fresh keys), so the logits are the full-precision
    cache's, bit for bit; without it, they are the 8-bit rows'."""
    prompts = [[5, 9, 2], [7, 7, 3, 1]]
    exact = _greedy(_engine("auto"), prompts, 4)
    assert _greedy(_engine(kv), prompts, 4) == exact
    tokens, logprobs = _greedy(_engine(kv, tail=False), prompts, 4)
    assert logprobs != exact[1]


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_with_the_tail_a_request_reads_the_same_alone_or_batched(kv) -> None:
    """A request's slot, and the step its current block moves to the pool, follow its own steps
    only: its tokens do not depend on what it is batched with. (Prefix caching is off: a hit reads
    the cached prompt's 8-bit rows where a fresh prompt's step reads its own keys.)"""
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 16, 23)]
    engine = _engine(kv)
    batched = _greedy(engine, prompts, 12)
    alone = [_greedy(engine, [p], 12) for p in prompts]
    assert batched[0] == [tokens[0] for tokens, _ in alone]
    # Log-probabilities to rounding: a batch's decode gathers pad its contexts to the longest.
    torch.testing.assert_close(torch.tensor(batched[1]), torch.tensor([lp[0] for _, lp in alone]))


def _eight_bit_step(contexts: list[int], q_lens: list[int], backend, tail: bool, last_rows: bool = False):
    """One attention step of a layer over an e4m3 cache with key summaries, earlier tokens stored as
    previous steps would have (into each sequence's current block's slot too, with the tail); this
    step's rows' output (with `last_rows`, each sequence's last row's only)."""
    from tgserve.kernels.reference import update_key_summaries, write_tail
    from tgserve.server.attention.backend import AttentionLayerParams
    from tgserve.server.kv_cache.spec import KVCacheSpec
    from tgserve.server.kv_cache.tail_blocks import LayerTail
    from tgserve.server.testing.attention_steps import step_metadata

    gen = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 8, 8, 2, 16
    sizes = [-(-n // block_size) for n in contexts]
    order = torch.randperm(sum(sizes) + 2, generator=gen).tolist()
    tables = [order[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
    cache = torch.zeros(2, len(order), block_size, kv_heads, dim, dtype=FP8)
    scale = torch.zeros(2, len(order), kv_heads, block_size)
    summary = torch.zeros(2, len(order), kv_heads, dim)
    layer_tail = LayerTail(torch.zeros(2, len(contexts), block_size, kv_heads, dim),
                           torch.full((len(order),), -1, dtype=torch.int32))  # fmt: skip
    queries, keys, values, slots = [], [], [], []
    for seq, (table, n, q_len) in enumerate(zip(tables, contexts, q_lens, strict=True)):
        if tail:
            layer_tail.slot_of[table[(n - 1) // block_size]] = seq
        k, v = torch.randn(2, n, kv_heads, dim, generator=gen)
        pos = torch.arange(n)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        write_kv(k[: n - q_len], v[: n - q_len], cache, slot[: n - q_len], scale)
        write_tail(k[: n - q_len], v[: n - q_len], slot[: n - q_len], layer_tail.as_kernel_args)
        update_key_summaries(k[: n - q_len], slot[: n - q_len], summary, block_size)
        queries.append(torch.randn(q_len, heads, dim, generator=gen))
        keys.append(k[n - q_len :]), values.append(v[n - q_len :]), slots.append(slot[n - q_len :])
    meta = step_metadata(tables, contexts, q_lens, torch.cat(slots), block_size)
    layer = AttentionLayerParams(KVCacheSpec(kv_heads, dim, FP8), dim**-0.5, kv_scale=scale, key_summary=summary,
                                 tail=layer_tail if tail else None)  # fmt: skip
    inputs = (torch.cat(queries), torch.cat(keys), torch.cat(values), cache, backend.plan(meta), layer)
    if last_rows:
        return backend.forward_rows(*inputs, meta.query_start_loc[1:].long() - 1)
    return backend.forward(*inputs)


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [1, 1, 30, 1]], ids=["decode", "mixed"])
@pytest.mark.parametrize("select", [False, True])
def test_the_cuda_path_reads_the_tail_as_the_cpu_backend(q_lens: list[int], select: bool) -> None:
    """The cuda backend over CPU tensors runs its kernels' twins with the tail: decode, mixed steps
    (a prompt chunk's rows and decode rows), selection, and a last layer's kept rows all read each
    current block from its slot as the cpu backend does; without the tail the output differs."""
    from tgserve.kernels.decode_selection import DecodeSelection
    from tgserve.server.attention.cpu import CpuAttentionBackend
    from tgserve.server.attention.cuda import CudaAttentionBackend

    selection = DecodeSelection(64, 64, sink=8, recent=16) if select else None
    contexts = [200, 150, 90, 45]
    cpu = _eight_bit_step(contexts, q_lens, CpuAttentionBackend(selection), tail=True)
    cuda = _eight_bit_step(contexts, q_lens, CudaAttentionBackend(None, selection), tail=True)
    torch.testing.assert_close(cuda, cpu, atol=1e-5, rtol=1e-5)
    last = [start + q - 1 for start, q in zip([0, 1, 2, 2 + q_lens[2]], q_lens, strict=True)]
    without = _eight_bit_step(contexts, q_lens, CpuAttentionBackend(selection), tail=False)
    # Each sequence's last row attends its current block (a chunk's earlier rows may not reach it).
    assert (cpu[last] - without[last]).abs().amax(-1).amax(-1).gt(1e-4).all()
    cuda_last = _eight_bit_step(
        contexts, q_lens, CudaAttentionBackend(None, selection), tail=True, last_rows=True
    )
    torch.testing.assert_close(cuda_last, cpu[last], atol=1e-5, rtol=1e-5)
