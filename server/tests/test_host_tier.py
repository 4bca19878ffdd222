"""The host tier of the prefix cache (--kv-offload-gb): full blocks evicted from the KV pool are kept
in a second (host) pool and loaded back on a prefix hit, giving the tokens recomputation gives; a
full host tier evicts and never fails a request; aborts leak no block."""

from __future__ import annotations

import random

import pytest
import torch

from tgserve import LLM, SamplingParams
from tgserve.kernels.kv_format import dequantize_kv, quantize_kv
from tgserve.server.core.block_manager import BlockManager
from tgserve.server.core.host_tier import HostTier, KVTransfers
from tgserve.server.core.request import Request
from tgserve.server.engine import model_shard
from tgserve.server.kv_cache import host_pool
from tgserve.server.kv_cache.host_pool import HostKVPool
from tgserve.server.kv_cache.key_copies import HostKeyCopies
from tgserve.server.testing.fixtures import fixture_path

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
# 192 tokens of KV, in float32 on every device: the swap test's tokens are exact only where the
# numerics do not depend on the batch (a bf16 run on a GPU diverges at near ties when preempted,
# swapped or recomputed alike).
POOL = dict(max_num_batched_tokens=64, block_size=8, num_blocks=24, dtype="float32")
HOST_GIB = 32 * 4096 / 2**30  # 32 blocks of the fixture's 4 KiB: room for all that the prompts evict


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_new_tokens=4))


def test_host_tier_keeps_the_most_recent_blocks_and_spares_those_being_read():
    tier = HostTier(2)
    tier.offer(101, device_block=5)
    tier.offer(102, device_block=6)
    assert tier.take_transfers() == KVTransfers(offloads=[(5, 0), (6, 1)])
    tier.reserve([tier.lookup(101)])  # a load of 101 is planned this step: 102 goes instead
    tier.offer(103, device_block=7)
    assert tier.lookup(102) is None and tier.lookup(101) == 0 and tier.lookup(103) == 1
    assert tier.counters.evicted_blocks == 1
    tier.take_transfers()
    tier.offer(101, device_block=9)  # held already: refreshed, not copied again
    assert not tier.take_transfers()
    tier.offer(104, device_block=8)  # 103 is now the least recently used
    assert tier.lookup(103) is None and tier.lookup(104) == 1


def test_host_tier_uses_only_the_memory_allocated_so_far():
    tier = HostTier(3, ready=0)
    tier.offer(101, device_block=5)  # no host block yet: not kept, nothing copied
    assert tier.lookup(101) is None and not tier.take_transfers()
    tier.grow(2)
    tier.offer(102, device_block=6)
    tier.offer(103, device_block=7)
    tier.offer(104, device_block=8)  # the two ready blocks are used: 102 goes
    assert tier.lookup(102) is None and {tier.lookup(103), tier.lookup(104)} == {0, 1}
    tier.grow(10)  # never past the capacity
    assert tier.num_blocks == 3


def test_an_evicted_prefix_comes_back_from_host_blocks():
    bm = BlockManager(num_blocks=4, block_size=2, host_tier=HostTier(8))
    first = _request("a", [1, 2, 3, 4, 5])
    bm.allocate_slots(first, 5)
    bm.cache_full_blocks(first, 5)
    bm.free(first)
    bm.allocate_slots(_request("b", [9] * 8), 8)  # takes every block: a's two full blocks go to host
    assert len(bm.take_kv_transfers().offloads) == 2
    bm.free(_request("b", [9] * 8))
    again = _request("c", [1, 2, 3, 4, 7])
    hit = bm.lookup_prefix(again)
    assert hit.block_ids == [] and len(hit.host_blocks) == 2 and hit.num_tokens == 4
    new = bm.allocate_slots(again, 1, hit.block_ids, hit.host_blocks)
    loads = bm.take_kv_transfers().loads
    assert [device for _, device in loads] == new[:2]
    assert bm.get_computed_blocks(_request("d", [1, 2, 3, 4, 8]))[1] == 4  # cached on the device again


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("staging_blocks", [None, 1])  # everything at once, or a block at a time
def test_host_pool_round_trips_every_block_tensor(dtype, staging_blocks, monkeypatch):
    if staging_blocks:
        monkeypatch.setattr(host_pool, "STAGING_BYTES", 1)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 4, 2, 8, generator=gen).to(dtype)
    scales = torch.rand(2, 6, 2, 4, generator=gen)
    pool = HostKVPool([cache, scales], num_blocks=3, device=torch.device("cpu"))
    assert pool.block_bytes == 2 * (4 * 2 * 8 * cache.element_size() + 2 * 4 * 4)
    before = cache.view(torch.uint8).clone(), scales.clone()
    pool.apply(KVTransfers(offloads=[(1, 2), (4, 0)]))
    pool.apply(KVTransfers(loads=[(2, 5), (0, 3)]))
    assert torch.equal(cache.view(torch.uint8)[:, 5], before[0][:, 1])
    assert torch.equal(cache.view(torch.uint8)[:, 3], before[0][:, 4])
    assert torch.equal(scales[:, 5], before[1][:, 1]) and torch.equal(scales[:, 0], before[1][:, 0])


def test_host_pool_layer_views_read_the_rows_in_the_pools_own_layout():
    """What a kernel reads in place: each pool tensor's blocks where they lie in the host rows."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 8, 4, 2, 8, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 8, 2, 4, generator=gen)
    pool = HostKVPool([cache, scales], num_blocks=5, device=torch.device("cpu"))
    pool.apply(KVTransfers(offloads=[(0, 4), (6, 1), (2, 2)]))
    host_cache, host_scales = pool.layer_views()
    assert host_cache.shape == (2, 5, 4, 2, 8) and host_cache.dtype == torch.float8_e4m3fn
    assert host_scales.shape == (2, 5, 2, 4) and host_scales.dtype == torch.float32
    for device_block, host_block in [(0, 4), (6, 1), (2, 2)]:
        assert torch.equal(
            host_cache.view(torch.uint8)[:, host_block], cache.view(torch.uint8)[:, device_block]
        )
        assert torch.equal(host_scales[:, host_block], scales[:, device_block])
    host_scales[1, 4] = 7.0  # the views alias the rows: a load brings what they hold
    pool.apply(KVTransfers(loads=[(4, 7)]))
    assert (scales[1, 7] == 7.0).all()


def test_host_pool_keeps_the_host_blocks_summaries_in_device_memory():
    """What selection reads of host blocks every step stays in device memory: offloads copy each
    block's summary there too, at its host block."""
    gen = torch.Generator().manual_seed(2)
    cache, summary = torch.randn(2, 6, 4, 2, 8, generator=gen), torch.randn(2, 6, 2, 8, generator=gen)
    pool = HostKVPool([cache, summary], num_blocks=4, device=torch.device("cpu"))
    on_device = torch.zeros(2, 4, 2, 8)
    pool.keep_on_device([(summary, on_device)])
    pool.apply(KVTransfers(offloads=[(5, 3), (1, 0)]))
    assert torch.equal(on_device[:, 3], summary[:, 5]) and torch.equal(on_device[:, 0], summary[:, 1])
    assert not on_device[:, 1:3].any()


def test_key_copies_take_ring_slots_newest_offloads_first():
    """Offloads copy their blocks' keys (e4m3, as the fp8 cache stores them) into the next slots of
    a ring: the oldest copy gives its slot up, a host block written anew loses its old copy, and
    more blocks than slots at once keep the last ones."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 8, 4, 2, 16, generator=gen)
    copies = HostKeyCopies([(cache, None)], slots=3, host_blocks=6)
    offload = lambda device, host: copies.copy(torch.tensor(device), torch.tensor(host))  # noqa: E731
    offload([0, 1], [4, 5])
    offload([2, 3], [0, 1])  # the ring wraps: host block 4's slot goes to host block 1
    assert copies.slot_of.tolist() == [2, 0, -1, -1, -1, 1]
    layer = copies.layers[0]
    keys, scales = quantize_kv(cache[0, 3].reshape(-1, 2, 16))
    assert torch.equal(layer.keys[0].view(torch.uint8), keys.view(4, 2, 16).view(torch.uint8))
    assert torch.equal(layer.scales[0], scales.view(4, 2).t())
    offload([6], [0])  # host block 0 written anew: its slot 2 is dropped, slot 1 taken from host block 5
    assert copies.slot_of.tolist() == [1, 0, -1, -1, -1, -1]
    offload([4, 5, 6, 7], [2, 3, 4, 5])  # more than the slots: the last three are copied
    assert copies.slot_of.tolist() == [-1, -1, -1, 2, 0, 1]
    dequantized = dequantize_kv(layer.keys[1], layer.scales[1].t())
    assert torch.allclose(dequantized, cache[0, 7], rtol=0.07, atol=1e-4)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """A 64-token prefix asked twice, with two 150-token prompts between that evict it from the pool."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731
    shared = words(64)
    return [shared + words(10), words(150), words(150), shared + words(12)]


@pytest.fixture(scope="module")
def recomputed() -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(fixture_path("llama")), **POOL)
    prompts = _prompts(llm.engine.vocab_size)
    return prompts, [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_host_hits_give_the_tokens_of_recomputation(recomputed, kv_cache_dtype):
    prompts, want = recomputed
    llm = LLM(str(fixture_path("llama")), kv_offload_gb=HOST_GIB, kv_cache_dtype=kv_cache_dtype, **POOL)
    got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    stats = llm.engine.stats()
    assert stats.host_prefix_hits == 64 and stats.host_loaded_blocks == 8  # the whole shared prefix
    if kv_cache_dtype == "auto":  # fp8 rounds the KV: the same tokens are likely, not promised
        assert got == want
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_full_host_tier_evicts_and_fails_nothing(recomputed):
    prompts, want = recomputed
    llm = LLM(str(fixture_path("llama")), kv_offload_gb=4 * 4096 / 2**30, **POOL)  # 4 blocks of 4 KiB
    assert llm.engine.stats().host_num_total_blocks == 4
    got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    stats = llm.engine.stats()
    assert got == want and stats.host_evicted_blocks > 0 and stats.host_num_used_blocks == 4


def test_aborting_requests_with_transfers_in_their_step_leaks_no_block(recomputed):
    prompts, _ = recomputed
    llm = LLM(str(fixture_path("llama")), kv_offload_gb=HOST_GIB, **POOL)
    for p in prompts[:3]:
        llm.generate([p], GREEDY)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    engine.add_request("again", prompts[3], params)
    engine.add_request("other", prompts[1], params)
    engine.step()  # loads the shared prefix from host, offloads what the other prompt evicts
    assert engine.stats().host_loaded_blocks == 8
    engine.abort_requests(["again", "other"])
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.host_num_used_blocks <= stats.host_num_total_blocks


def test_a_host_tier_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="kv-offload-gb .*at least one block"):
        LLM(str(fixture_path("llama")), kv_offload_gb=1e-9, **POOL)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_live_kv_three_times_the_pool_completes_by_swapping(async_scheduling):
    """Six requests of 100 tokens each against a 192-token pool: preempted ones are swapped to the
    host tier and back (with async scheduling, some with a token in flight), and every request gets
    the tokens a pool that holds them all gives."""
    rng = random.Random(4)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    model = str(fixture_path("llama"))
    large = LLM(model, **{**POOL, "num_blocks": 128})
    prompts = [[rng.randrange(5, large.engine.vocab_size) for _ in range(60)] for _ in range(6)]
    want = [out.token_ids for out in large.generate(prompts, params)]
    llm = LLM(model, kv_offload_gb=HOST_GIB * 4, async_scheduling=async_scheduling, **POOL)
    got = [out.token_ids for out in llm.generate(prompts, params)]
    stats = llm.engine.stats()
    assert got == want
    assert stats.host_swapped_out_requests > 0 and stats.num_preemptions == stats.host_swapped_out_requests
    assert stats.num_free_blocks == stats.num_total_blocks
    assert llm.engine.scheduler.block_manager.host_tier.num_held_blocks == 0


# ---- the long-context tier: one request larger than the pool -----------------------------------


@pytest.mark.parametrize(
    "kv_cache_dtype,budget",
    [("auto", 0), ("fp8", 0), ("auto", 512), ("fp8", 128), ("int8", 128)],
)
def test_a_request_larger_than_the_pool_reads_its_spilled_blocks_from_host(kv_cache_dtype, budget):
    """One request whose KV (prompt and output, 476 tokens) is 2.5x the 192-token pool: its cold
    blocks spill to the host tier as it grows, and attention (prefill chunks, then decode: dense,
    selecting over a budget that covers the context, or over one of 128 tokens) reads them there.
    The tokens are those of a pool that holds it all, with the same selection; its host blocks are
    given back when it ends."""
    rng = random.Random(7)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    model = str(fixture_path("llama"))
    extra: dict = dict(kv_cache_dtype=kv_cache_dtype)
    extra.update(decode_attention_budget=budget, decode_attention_min_context=64)
    large = LLM(model, **{**POOL, "num_blocks": 128}, **extra)
    prompt = [rng.randrange(5, large.engine.vocab_size) for _ in range(436)]
    want = large.generate([prompt], params)[0].token_ids
    llm = LLM(model, kv_offload_gb=HOST_GIB * 2, **POOL, **extra)
    got = llm.generate([prompt], params)[0].token_ids
    stats = llm.engine.stats()
    assert got == want
    assert stats.host_spilled_blocks >= 60 - 24 and stats.num_preemptions == 0
    if (
        budget
    ):  # selection rescored host candidates from device copies of their keys (lossless from an 8-bit cache)
        assert int((llm.engine.shard.host_pool.key_copies.slot_of >= 0).sum()) > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert llm.engine.scheduler.block_manager.host_tier.num_held_blocks == 0


def test_a_prompt_chunk_longer_than_the_pool_is_shortened_not_left_waiting():
    """A budget of 256 tokens against the 192-token pool: the lone 300-token prompt's first chunk
    could never be allocated; it takes what the pool holds, spills, and ends as a larger pool's."""
    rng = random.Random(10)
    model = str(fixture_path("llama"))
    large = LLM(model, **{**POOL, "num_blocks": 128})
    prompt = [rng.randrange(5, large.engine.vocab_size) for _ in range(300)]
    want = large.generate([prompt], GREEDY)[0].token_ids
    llm = LLM(model, kv_offload_gb=HOST_GIB * 2, **{**POOL, "max_num_batched_tokens": 256})
    assert llm.generate([prompt], GREEDY)[0].token_ids == want
    assert llm.engine.stats().num_preemptions == 0


def test_a_spilled_request_aborted_mid_decode_leaks_no_block():
    rng = random.Random(8)
    llm = LLM(str(fixture_path("llama")), kv_offload_gb=HOST_GIB * 2, **POOL)
    engine = llm.engine
    prompt = [rng.randrange(5, engine.vocab_size) for _ in range(300)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True))
    while (
        engine.stats().host_spilled_blocks == 0 or engine.scheduler.get_request("long").num_output_tokens < 3
    ):
        engine.step()
    engine.abort_requests(["long"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # the step after the abort gives its host blocks back
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.scheduler.block_manager.host_tier.num_held_blocks == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_contexts_that_together_outgrow_the_pool_run_side_by_side_spilling(prefix_caching):
    """Three requests of 220 tokens each (prompt and output) against the 192-token pool, long
    contexts to selective decode (past 64 tokens; a budget that covers them, so exact): rather than
    preempt one another, they spill each other's cold blocks to the host tier and all run to the
    end together, with the tokens of a pool that holds them all."""
    rng = random.Random(9)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    model = str(fixture_path("llama"))
    selecting = dict(
        decode_attention_budget=256, decode_attention_min_context=64, enable_prefix_caching=prefix_caching
    )
    large = LLM(model, **{**POOL, "num_blocks": 128}, **selecting)
    prompts = [[rng.randrange(5, large.engine.vocab_size) for _ in range(200)] for _ in range(3)]
    want = [out.token_ids for out in large.generate(prompts, params)]
    # Prompt chunks of 4 blocks: what the others' cold blocks can always make room for.
    llm = LLM(model, kv_offload_gb=HOST_GIB * 4, **{**POOL, "max_num_batched_tokens": 32}, **selecting)
    got = [out.token_ids for out in llm.generate(prompts, params)]
    stats = llm.engine.stats()
    assert got == want
    assert stats.host_spilled_blocks >= 2 * 24 and stats.num_preemptions == 0  # twice the pool moved
    assert stats.num_free_blocks == stats.num_total_blocks
    assert llm.engine.scheduler.block_manager.host_tier.num_held_blocks == 0


def test_chosen_host_blocks_are_read_from_the_hot_block_cache_token_exact(monkeypatch):
    """Selective decode over a request 2.5x the pool (budget 128 tokens) keeps the host blocks it
    chooses in the hot-block cache (half the pool's bytes here: 12 device blocks) and reads them
    there on later steps; tokens as a pool that holds it all. A second round of prompts spills
    into the same host blocks, written anew: what the cache held of them is forgotten, and the
    tokens are still exact."""
    monkeypatch.setattr(model_shard, "HOT_BLOCK_SHARE", 0.5)
    rng = random.Random(12)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    model = str(fixture_path("llama"))
    # fp8: the candidates' keys copied to the device for rescoring are then lossless (see above).
    selecting = dict(decode_attention_budget=128, decode_attention_min_context=64, kv_cache_dtype="fp8")
    large = LLM(model, **{**POOL, "num_blocks": 128}, **selecting)
    rounds = [[[rng.randrange(5, large.engine.vocab_size) for _ in range(436)]] for _ in range(2)]
    llm = LLM(model, kv_offload_gb=HOST_GIB * 2, **POOL, **selecting)
    hot = llm.engine.shard.host_pool.hot_blocks
    assert hot.slots == 12 and llm.engine.shard.first_host_block_id == 24 + 12
    for prompts in rounds:
        assert llm.generate(prompts, params)[0].token_ids == large.generate(prompts, params)[0].token_ids
    hits, misses = hot.counts()
    assert hits > 0 and misses > 0
    stats = llm.engine.stats()
    assert (stats.host_hot_block_hits, stats.host_hot_block_misses) == (hits, misses)  # /metrics reads these
    assert stats.host_spilled_blocks >= 2 * (60 - 24) and stats.num_preemptions == 0
    assert stats.num_free_blocks == stats.num_total_blocks == 24


def test_a_request_aborted_while_its_host_blocks_are_held_leaves_nothing_stale(monkeypatch):
    """A spilled request whose chosen host blocks the hot-block cache holds is aborted mid-decode;
    the next request spills into the same host blocks and reads only its own keys and values (the
    tokens of a pool that holds it all), and no block of either pool is left held."""
    monkeypatch.setattr(model_shard, "HOT_BLOCK_SHARE", 0.5)
    rng = random.Random(13)
    model = str(fixture_path("llama"))
    selecting = dict(decode_attention_budget=128, decode_attention_min_context=64, kv_cache_dtype="fp8")
    llm = LLM(model, kv_offload_gb=HOST_GIB * 2, **POOL, **selecting)
    engine, hot = llm.engine, llm.engine.shard.host_pool.hot_blocks
    first, second = ([rng.randrange(5, engine.vocab_size) for _ in range(400)] for _ in range(2))
    engine.add_request("first", first, SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True))
    while hot.counts()[0] == 0 or engine.scheduler.get_request("first").num_output_tokens < 8:
        engine.step()
    engine.abort_requests(["first"])
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    want = LLM(model, **{**POOL, "num_blocks": 128}, **selecting).generate([second], params)[0].token_ids
    assert llm.generate([second], params)[0].token_ids == want
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert engine.scheduler.block_manager.host_tier.num_held_blocks == 0


def test_layers_sharing_keys_and_values_spill_and_select_as_one(tmp_path, monkeypatch):
    """Gemma 4 with its last layers reading earlier layers' keys and values (one cache between
    them), a prompt larger than the pool: the shared caches spill to host and are selected over
    and held in the hot-block cache as one; tokens of a pool that holds it all."""
    from tgserve.server.testing.arch_sweep import run_one

    monkeypatch.setattr(model_shard, "HOT_BLOCK_SHARE", 0.5)
    kinds = ["sliding_attention", "full_attention"] * 2
    row = run_one("gemma4_text", "Gemma4ForCausalLM", tmp_path, layer_types=kinds, num_hidden_layers=4,
                  num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1)  # fmt: skip
    assert row.status == "exact", row
    path, rng = str(tmp_path / "gemma4_text"), random.Random(3)
    selecting = dict(decode_attention_budget=128, decode_attention_min_context=64, kv_cache_dtype="fp8")
    large = LLM(path, **{**POOL, "num_blocks": 128}, **selecting)
    prompt = [rng.randrange(5, large.engine.vocab_size) for _ in range(300)]
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    want = large.generate([prompt], params)[0].token_ids
    host_gib = 64 * large.engine.shard.host_block_bytes / 2**30
    llm = LLM(path, kv_offload_gb=host_gib, **POOL, **selecting)
    assert llm.generate([prompt], params)[0].token_ids == want
    assert (
        llm.engine.stats().host_spilled_blocks > 0 and llm.engine.shard.host_pool.hot_blocks.counts()[0] > 0
    )
