"""The cpu backend (and the cuda backend's kept-row path, on CPU tensors) against dense attention
computed from unpaged keys and values."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import INT8, dequantize_kv, quantize_kv
from tgserve.kernels.reference import write_kv
from tgserve.server.attention.backend import AttentionLayerParams
from tgserve.server.attention.cpu import CpuAttentionBackend
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.config.buckets import BucketConfig
from tgserve.server.kv_cache.spec import KVCacheSpec
from tgserve.server.static_shapes.buckets import StaticShapes
from tgserve.server.static_shapes.padding import pad_metadata, pad_rows


def dense_reference(q, k, v, scale, window, softcap):
    """q [Lq, H, D] are the last Lq positions of k, v [L, Hkv, D]; heads repeated, plain softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def run_backend(contexts, q_lens, num_heads, num_kv, dim, block_size, window, softcap, seed=0, backend=None,
                rows=None, static=None, eight_bits=None, fresh_from_cache=False):  # fmt: skip
    """Earlier tokens are written first (as previous steps would), then one step of q_lens per
    sequence; with rows, only those query rows are asked for (and expected); with static
    (StaticShapes), the step is padded to its bucket first, as the static-shape runner pads it.

    eight_bits (FP8 or INT8): the cache stores that format with scales, and the expected attention
    reads keys and values as
    the cache gives them back (dequantized) wherever the backend reads the cache: every sequence
    with a cached prefix or one query, and fresh prompts too with fresh_from_cache (their step's own
    keys otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in contexts) + 3
    cache = torch.zeros(2, num_blocks, block_size, num_kv, dim, dtype=eight_bits or torch.float32)
    kv_scale = torch.zeros(2, num_blocks, num_kv, block_size) if eight_bits else None
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # scattered, non-contiguous blocks
    tables, full = [], []
    for n in contexts:
        tables.append([free.pop() for _ in range(math.ceil(n / block_size))])
        full.append(tuple(torch.randn(n, h, dim, generator=gen) for h in (num_heads, num_kv, num_kv)))
    backend = backend or CpuAttentionBackend()
    spec = KVCacheSpec(num_kv, dim, cache.dtype, window)
    layer = AttentionLayerParams(spec, dim**-0.5, softcap, kv_scale=kv_scale)

    # Previous steps: store the context before this step's queries.
    def slot(table, p):
        return table[p // block_size] * block_size + p % block_size

    for (_q, k, v), table, n, ql in zip(full, tables, contexts, q_lens):
        slots = torch.tensor([slot(table, p) for p in range(n - ql)], dtype=torch.long)
        write_kv(k[: n - ql], v[: n - ql], cache, slots, kv_scale)
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    query = torch.cat([q[n - ql :] for (q, _, _), n, ql in zip(full, contexts, q_lens)])
    key = torch.cat([k[n - ql :] for (_, k, _), n, ql in zip(full, contexts, q_lens)])
    value = torch.cat([v[n - ql :] for (_, _, v), n, ql in zip(full, contexts, q_lens)])
    slots = [slot(t, p) for t, n, ql in zip(tables, contexts, q_lens) for p in range(n - ql, n)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(contexts),
        block_size=block_size,
    )

    def as_read(x, n, ql):
        reads_cache = eight_bits and (ql < n or ql == 1 or fresh_from_cache)  # one query: a decode group
        return dequantize_kv(*quantize_kv(x, eight_bits)) if reads_cache else x

    expected = torch.cat(
        [
            dense_reference(q[n - ql :], as_read(k, n, ql), as_read(v, n, ql), dim**-0.5, window, softcap)
            for (q, k, v), n, ql in zip(full, contexts, q_lens)
        ]
    )
    if rows is None:
        return backend.forward(query, key, value, cache, backend.plan(meta), layer), expected
    rows = torch.tensor(rows, dtype=torch.long)
    kept = len(rows)
    if static is not None:
        shape = static.shape_for(len(query), len(contexts), width, kept, meta.is_fresh)
        meta = pad_metadata(meta, shape)
        query, key, value = (pad_rows(t, shape.num_tokens, 0) for t in (query, key, value))
        rows = pad_rows(rows, shape.num_logits, 0)  # padding logit rows repeat row 0
    out = backend.forward_rows(query, key, value, cache, backend.plan(meta), layer, rows)[:kept]
    if eight_bits:
        return out, expected[rows[:kept]]
    # Every row's keys and values were stored: the cache now answers a full step's queries too.
    for (_q, k, v), table, n in zip(full, tables, contexts):
        slots = torch.tensor([slot(table, p) for p in range(n)], dtype=torch.long)
        assert torch.equal(cache[0].flatten(0, 1)[slots], k) and torch.equal(cache[1].flatten(0, 1)[slots], v)
    return out, expected[rows[:kept]]


@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (7, 50.0)])
def test_mixed_prefill_and_decode_match_dense(num_heads, num_kv, window, softcap):
    contexts = [1, 9, 17, 33, 16, 40, 5]
    q_lens = [1, 9, 1, 12, 1, 1, 5]  # fresh prompts, chunks after a prefix, and decodes
    out, expected = run_backend(contexts, q_lens, num_heads, num_kv, 16, 8, window, softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_all_decode_batch_matches_dense():
    contexts = [3, 8, 9, 64, 2]
    out, expected = run_backend(contexts, [1] * 5, 8, 2, 32, 4, None, None, seed=3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (7, 50.0)])
@pytest.mark.parametrize("eight_bits", [FP8, INT8], ids=["e4m3", "int8"])
def test_8_bit_cache_mixed_steps_match_dense_over_what_the_cache_holds(num_heads, num_kv, window, softcap,
                                                                       eight_bits):  # fmt: skip
    """An 8-bit cache: decode groups and chunks after a prefix read the stored rows back dequantized,
    fresh prompts attend over their own keys; each as dense attention over those keys."""
    contexts = [1, 9, 17, 33, 16, 40, 5, 30, 31]
    q_lens = [1, 9, 1, 12, 1, 1, 5, 1, 1]
    out, expected = run_backend(
        contexts, q_lens, num_heads, num_kv, 16, 8, window, softcap, eight_bits=eight_bits
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name,case", [("cpu", "fresh-last-rows"), ("cpu", "paged"), ("cuda", "paged"),
                                               ("cuda", "fresh-last-rows")])  # fmt: skip
def test_fp8_cache_kept_rows_match_dense(backend_name, case):
    """The cuda backend's kept rows run as decode queries over the (fp8) cache, fresh prompts too."""
    from tgserve.server.attention.cuda import CudaAttentionBackend

    backend = CpuAttentionBackend() if backend_name == "cpu" else CudaAttentionBackend()
    contexts, q_lens, rows = ROW_CASES[case]
    out, expected = run_backend(contexts, q_lens, 8, 2, 16, 4, 6, 30.0, seed=7, backend=backend, rows=rows,
                                eight_bits=FP8, fresh_from_cache=backend_name == "cuda")  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 20.0)])
def test_decode_groups_of_similar_lengths_match_dense(window, softcap):
    contexts = [30, 31, 33, 29, 60, 61, 2, 3]  # three groups of similar block counts
    out, expected = run_backend(contexts, [1] * len(contexts), 8, 2, 16, 8, window, softcap, seed=5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


ROW_CASES = {
    # fresh prompts only (the cuda backend's dense / sparse path): the last row of each, and
    # every row of one (prompt log-probabilities)
    "fresh": (
        [9, 17, 5],
        [9, 17, 5],
        [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 30],
    ),
    "fresh-last-rows": ([9, 17, 5], [9, 17, 5], [8, 25, 30]),
    # chunks after a prefix beside decodes (the paged path)
    "paged": ([1, 9, 17, 33, 40], [1, 9, 1, 12, 1], [0, 9, 10, 15, 22, 23]),
    "decode": ([3, 8, 9], [1, 1, 1], [0, 2]),
}


@pytest.mark.parametrize("backend_name", ["cpu", "cuda"])
@pytest.mark.parametrize("case", list(ROW_CASES))
@pytest.mark.parametrize("window,softcap", [(None, None), (6, 30.0)])
def test_kept_rows_match_dense(backend_name, case, window, softcap):
    """Attention of a subset of the query rows (a last layer that feeds only its logit rows). The
    cuda backend runs each kept row as a decode query over its own context; on CPU tensors its
    kernels fall back to the torch reference, so the row-to-sequence mapping is checked here."""
    from tgserve.server.attention.cuda import CudaAttentionBackend

    backend = CpuAttentionBackend() if backend_name == "cpu" else CudaAttentionBackend()
    contexts, q_lens, rows = ROW_CASES[case]
    out, expected = run_backend(
        contexts, q_lens, 8, 2, 16, 4, window, softcap, seed=7, backend=backend, rows=rows
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", ["cpu", "cuda"])
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_kept_rows_of_steps_padded_to_static_shapes_match_dense(backend_name, case):
    """The static-shape runner (Gaudi's, run on CUDA too) pads a step to its bucket; a fresh step's
    block table keeps one column, which the cuda backend's kept rows must not read as their context
    (on a GPU they read past the table: an illegal memory access)."""
    from tgserve.server.attention.cuda import CudaAttentionBackend

    backend = CpuAttentionBackend() if backend_name == "cpu" else CudaAttentionBackend()
    contexts, q_lens, rows = ROW_CASES[case]
    static = StaticShapes(
        BucketConfig(token_step=16, batch_step=4, prefill_batch_step=2),
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4,
    )  # fmt: skip
    out, expected = run_backend(
        contexts, q_lens, 8, 2, 16, 4, None, None, seed=7, backend=backend, rows=rows, static=static
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kept_rows_of_the_memory_profiling_step_stay_in_the_placeholder_cache():
    """The KV pool is sized by running the largest prompt step over a one-block placeholder cache;
    the cuda backend reads that cache for the last layer's kept rows, so the step's block tables
    must name a block for every position (they named one per sequence, and the GPU read past them)."""
    from tgserve.server.attention.cuda import CudaAttentionBackend
    from tgserve.server.execution.memory import profiling_step

    block_size, num_kv, dim = 4, 2, 16
    meta = profiling_step(
        num_tokens=37, num_seqs=3, block_size=block_size, device=torch.device("cpu")
    ).metadata
    assert meta.block_tables.shape == (3, math.ceil(max(meta.seq_lens_cpu) / block_size))
    assert not meta.block_tables.any()
    cache = torch.zeros(2, 1, block_size, num_kv, dim)
    query, key, value = torch.randn(37, 8, dim), torch.randn(37, num_kv, dim), torch.randn(37, num_kv, dim)
    layer = AttentionLayerParams(KVCacheSpec(num_kv, dim, torch.float32, None), dim**-0.5, None)
    rows = meta.query_start_loc[1:].long() - 1
    backend = CudaAttentionBackend()
    out = backend.forward_rows(query, key, value, cache, backend.plan(meta), layer, rows)
    assert out.shape == (3, 8, dim) and out.isfinite().all()
