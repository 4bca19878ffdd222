"""Sparse prefill: Triton kernels against their torch twins, and the index semantics."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from triton.runtime.errors import OutOfResources

from tgserve.kernels import reference
from tgserve.kernels.sparse import estimate
from tgserve.kernels.sparse.attention import estimate_index, sparse_prefill
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.index import build_index, index_to_mask
from tgserve.kernels.sparse.kernel import sparse_attention_kernel
from tgserve.kernels.sparse.lastq import last_q_scores_triton
from tgserve.kernels.sparse.pooled import rescue_blocks_triton
from tgserve.kernels.testing import max_abs_err

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3}
MIXED = [  # rescue blocks by the mean and by the range (the vertical-slash head), by the mean alone
    HeadPattern("vertical_slash", vertical=10, slash=40, sink=4, local=8, rescue=2),
    HeadPattern("a_shape", sink=5, local=20),
    HeadPattern("block_sparse", blocks=3, rescue=1, rescue_range=0),
    HeadPattern("dense"),
]


@pytest.fixture(params=[True, False], ids=["descriptors", "pointers"])
def load_path(request, monkeypatch):
    """The sparse kernel's mask-free loads through tensor descriptors, or plain pointers."""
    from tgserve.kernels.sparse import kernel

    monkeypatch.setattr(kernel, "USE_DESCRIPTORS", request.param)
    return request.param


@pytest.fixture(params=[1, 2], ids=["cols1", "cols2"])
def column_blocks(request, monkeypatch):
    """Key columns a step in pass 2, in blocks: two blocks' worth of columns per step span more key
    blocks, so fewer chunks are clean and a chunk's tail more often runs past the column list."""
    from tgserve.kernels.sparse import kernel

    monkeypatch.setitem(kernel.LAUNCH, "column_blocks", request.param)
    return request.param


@pytest.fixture(params=[(1, 1), (2, 1), (1, 2), (2, 2)], ids=["walk1", "walk2", "walk1-wide", "walk2-wide"])
def walk_qblocks(request, monkeypatch):
    """Query blocks per program of the diagonal walk (two: the edge blocks are masked by row), and
    key blocks per mask-free step (two: runs of odd length end with a single block)."""
    from tgserve.kernels.sparse import kernel

    qblocks, key_blocks = request.param
    monkeypatch.setitem(kernel.WALK_LAUNCH, "qblocks", qblocks)
    monkeypatch.setitem(kernel.WALK_LAUNCH, "key_blocks", key_blocks)
    return qblocks


def _qkv(n: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads)]


# GQA 1, 4, 8 and MQA. Under the interpreter a case costs about a second a head: 16 heads run on the
# GPU only (10 s a case on CPU, 80 s in all), their group of 8 is the MQA case's.
HEAD_LAYOUTS = [(4, 4), (8, 2), pytest.param(16, 2, marks=pytest.mark.gpu, id="16-2"), (8, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
def test_sparse_kernel_matches_masked_reference(device, dtype, heads, kv_heads, load_path, column_blocks):
    """Mixed per-head patterns in one launch; n = 150 leaves a ragged last block of 16."""
    n, block = 150, 16
    q, k, v = _qkv(n, heads, kv_heads, 32, dtype, seed=heads + kv_heads)
    patterns = [MIXED[h % len(MIXED)] for h in range(heads)]
    index = estimate_index(q, k, 0.2, patterns, block, last_q=16)
    want = reference.masked_attention(q, k, v, index_to_mask(index), 0.2)
    moved = estimate_index(q.to(device), k.to(device), 0.2, patterns, block, last_q=16)
    out = torch.full_like(q, float("nan")).to(device)
    sparse_attention_kernel(q.to(device), k.to(device), v.to(device), moved, 0.2, out=out)
    assert torch.isfinite(out).all(), "rows left unwritten"
    assert max_abs_err(out.cpu(), want) <= ATOL[dtype]


@pytest.mark.parametrize("head_dim", [64, 96, 128])  # 96: not a power of two
def test_sparse_kernel_head_dims(device, head_dim):
    n, block = 64, 16
    q, k, v = _qkv(n, 4, 2, head_dim, torch.float16, seed=head_dim)
    index = estimate_index(q, k, head_dim**-0.5, MIXED, block, last_q=16)
    want = reference.masked_attention(q, k, v, index_to_mask(index), head_dim**-0.5)
    got = sparse_prefill(q.to(device), k.to(device), v.to(device), head_dim**-0.5, MIXED, block, 16,
                         use_triton=True)  # fmt: skip
    assert max_abs_err(got.cpu(), want) <= ATOL[torch.float16]


@pytest.mark.parametrize("n,block,last_q", [(150, 16, 16), (200, 32, 64), (37, 16, 64)])
def test_last_q_scores_triton_match_torch(device, n, block, last_q):
    """Vertical and block-diagonal scores of a head subset, ragged lengths, last_q > n."""
    q, k, _ = _qkv(n, 8, 2, 32, torch.float32, seed=n)
    heads = [0, 1, 3, 5, 6]
    want = estimate.vertical_slash_scores(q, k, heads, 0.3, last_q, block)
    got = last_q_scores_triton(q.to(device), k.to(device), heads, 0.3, last_q, block)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key_blocks,split_dots", [(1, False), (2, False), (4, False), (2, True), (4, True)])
@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("budget", [[2, 2, 2, 2, 2], [1, 3, 2, 5, 1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("query_range", [False, True])
def test_rescue_blocks_triton_match_torch(device, held, budget, key_blocks, split_dots, dtype, query_range,
                                          monkeypatch):  # fmt: skip
    """Top pooled-max blocks outside the held diagonals, listed blocks and column keys; key blocks
    one to four a step (10 query blocks: a step of 4 reaches past the last one), in one product
    or a product a block. fp16: products of e4m3 rows on both sides (with query_range, the query
    blocks' range bound: two products, each row's scale applied)."""
    from tgserve.kernels.sparse import pooled

    monkeypatch.setitem(pooled.LAUNCH, "key_blocks", key_blocks)
    monkeypatch.setitem(pooled.LAUNCH, "split_dots", split_dots)
    n, block = 150, 16
    q, k, _ = _qkv(n, 8, 2, 32, dtype, seed=7)
    gen = torch.Generator().manual_seed(3)
    # A contiguous run of heads is indexed by a slice, a scattered list by a device tensor.
    heads, nq = [0, 1, 3, 5, 6] if held else [1, 2, 3, 4, 5], -(-n // block)
    cover = torch.rand(5, nq, generator=gen) < 0.3
    listed = torch.randint(-1, nq, (5, nq, 3), generator=gen) if held else None
    columns = torch.randint(-1, n, (5, 7), generator=gen) if held else None
    want = estimate.rescue_blocks(q, k, heads, 0.3, block, cover, listed, columns, budget, query_range)
    moved = [None if x is None else x.to(device) for x in (cover, listed, columns)]
    got = rescue_blocks_triton(q.to(device), k.to(device), heads, block, *moved, budget, query_range)
    assert torch.equal(got.cpu().sort(-1).values, want.sort(-1).values)


def test_the_range_bound_is_the_largest_logit_of_any_query_in_the_block():
    """The range bound of (query block, key block) is at least the largest logit any of the
    block's queries gives any of its keys, and equals it for blocks of one query and one key."""
    q, k, _ = _qkv(64, 2, 2, 16, torch.float32, seed=9)
    for block in (8, 1):
        for h in range(2):
            exact = (q[:, h] @ k[:, h].t()) * 0.5
            largest = exact.view(64 // block, block, 64 // block, block).amax(dim=(1, 3))
            bound = estimate.pooled_max_scores(q[:, h : h + 1], k[:, h], 0.5, block, query_range=True)[0]
            causal = estimate.block_causal(64 // block, q.device)
            assert (bound[causal] >= largest[causal] - 1e-5).all()
            if block == 1:
                torch.testing.assert_close(bound[causal], largest[causal])


def test_rescue_keys_take_one_scale_a_kv_head():
    """The rescue's e4m3 keys are each KV head's keys quantized by that head's one scale, as the
    twin rounds them (`estimate.pooled_max_scores`)."""
    from tgserve.kernels.fp8_format import quantize_rows, tensor_scale
    from tgserve.kernels.sparse.pooled import _e4m3_keys

    _, k, _ = _qkv(150, 4, 2, 32, torch.bfloat16, seed=5)
    k[:, 1] *= 30.0  # heads of different ranges: one scale for both would not do
    got = _e4m3_keys(k)
    for h in range(2):
        want = quantize_rows(k[:, h], tensor_scale(k[:, h]))[0]
        assert torch.equal(got[:, h].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("query_range", [False, True])
def test_a_rescue_launch_takes_keys_quantized_once(device, query_range):
    """The keys quantized ahead (`rescue_keys`, shared by the launches by the mean and by the
    range) give the same blocks as 16-bit keys quantized by the launch itself."""
    from tgserve.kernels.sparse.pooled import rescue_keys

    n, block, heads = 150, 16, [0, 2, 3]
    q, k, _ = _qkv(n, 4, 2, 32, torch.float16, seed=11)
    q, k = q.to(device), k.to(device)
    cover = (torch.rand(3, -(-n // block), generator=torch.Generator().manual_seed(2)) < 0.3).to(device)
    each = rescue_blocks_triton(q, k, heads, block, cover, None, None, [2, 1, 3], query_range)
    shared = rescue_blocks_triton(q, rescue_keys(k), heads, block, cover, None, None, [2, 1, 3], query_range)
    assert rescue_keys(k).dtype == torch.float8_e4m3fn
    assert torch.equal(each, shared)


# Rescue blocks all by the mean (no range pass); split between the mean and the range bound, and
# all by the range (no mean pass).
MEAN = [replace(MIXED[0], rescue=1, rescue_range=0), *MIXED[1:]]
RANGED = [
    replace(MIXED[0], rescue=3, rescue_range=1),
    MIXED[1],
    replace(MIXED[2], rescue=2, rescue_range=2),
    replace(MIXED[0], rescue=2, rescue_range=2),
]


@pytest.mark.parametrize("mixed", [MEAN, MIXED, RANGED], ids=["mean", "mixed", "range"])
def test_triton_estimation_gives_the_torch_index(device, mixed):
    """The whole estimation, mixed per-head patterns: Triton and torch build the same mask."""
    n, block = 150, 16
    q, k, _ = _qkv(n, 8, 2, 32, torch.float32, seed=11)
    patterns = [mixed[h % len(mixed)] for h in range(8)]
    want = index_to_mask(estimate_index(q, k, 0.2, patterns, block, last_q=16))
    got = estimate_index(q.to(device), k.to(device), 0.2, patterns, block, last_q=16, use_triton=True)
    assert torch.equal(index_to_mask(got).cpu(), want)


def test_index_sources_are_a_union_without_double_counting(device):
    """Columns and blocks overlapping the diagonals (and each other) count once, kernel = mask."""
    n, block, nq = 96, 16, 6
    cover = torch.zeros(2, nq, dtype=torch.bool)
    cover[:, 0] = True
    cover[1, 2] = True
    blocks = torch.tensor([[[-1, -1]] * nq, [[0, 0], [0, 1], [0, 2], [1, 3], [2, 1], [5, 5]]])
    columns = torch.tensor([[3, 3, 17, 40, 95], [1, 33, 50, 70, 500]])  # duplicates, out of range
    index = build_index(n, block, cover, blocks, columns)
    mask = index_to_mask(index)
    assert index.block_count[1].tolist() == [0, 1, 0, 0, 1, 0]  # blocks on a selected diagonal dropped
    expected = reference.causal_mask(n, n)[None] & torch.zeros(2, n, n, dtype=torch.bool)
    pos = torch.arange(n)
    qb, kb = pos[:, None] // block, pos[None, :] // block
    expected[0] = (qb == kb) | torch.isin(pos, torch.tensor([3, 17, 40, 95]))[None, :]
    expected[1] = (qb == kb) | (qb - kb == 2) | torch.isin(pos, torch.tensor([1, 33, 50, 70]))[None, :]
    expected[1] |= ((qb == 1) & (kb == 0)) | ((qb == 4) & (kb == 1))
    expected &= reference.causal_mask(n, n)
    assert torch.equal(mask, expected)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 2, 16, generator=gen) for _ in range(3))
    want = reference.masked_attention(q, k, v, mask, 0.25)
    moved = build_index(n, block, cover.to(device), blocks.to(device), columns.to(device))
    got = sparse_attention_kernel(q.to(device), k.to(device), v.to(device), moved, 0.25)
    assert max_abs_err(got.cpu(), want) <= 2e-5


def test_diagonal_runs_reach_each_selected_key_block_once():
    """For every query block the runs' key ranges, plus the diagonal block where offset 0 is
    selected, are exactly the key blocks q - d of the selected offsets d <= q, each once."""
    from tgserve.kernels.sparse.index import diagonal_runs

    gen = torch.Generator().manual_seed(4)
    cover = torch.rand(6, 40, generator=gen) < 0.5
    cover[0] = True  # dense: one run from offset 1
    cover[1] = False
    cover[1, ::2] = True  # no two offsets consecutive: runs of one
    cover[2, 0] = False  # no diagonal block
    runs = diagonal_runs(cover)
    for h in range(cover.shape[0]):
        for q in range(cover.shape[1]):
            reached = [q] if cover[h, 0] else []
            count = runs.count[h, q]
            for a, b in zip(runs.first[h, :count].tolist(), runs.last[h, :count].tolist()):
                assert 1 <= a <= min(b, q)
                reached += range(max(q - b, 0), q - a + 1)
            want = [q - d for d in range(q + 1) if cover[h, d]]
            assert sorted(reached) == sorted(want), (h, q)


def _assert_kernel_matches_index(device, n, block, cover, blocks, columns, q, k, v):
    """The kernel over build_index(cover, blocks, columns), on `device`, against the masked reference."""
    index = build_index(n, block, cover, blocks, columns)
    want = reference.masked_attention(q, k, v, index_to_mask(index), 0.2)
    moved = build_index(n, block, *(None if t is None else t.to(device) for t in (cover, blocks, columns)))
    got = sparse_attention_kernel(q.to(device), k.to(device), v.to(device), moved, 0.2)
    assert max_abs_err(got.cpu(), want) <= 2e-5


@pytest.mark.parametrize("diagonal_block", [False, True])
def test_columns_span_chunks_and_reach_into_the_query_block(device, diagonal_block, load_path, column_blocks):
    """Many columns (several chunks before each query block, a causal tail inside it), with and
    without the diagonal block selected; listed blocks and diagonals hold some of the columns."""
    n, block, nq = 150, 16, 10
    gen = torch.Generator().manual_seed(5)
    cover = torch.zeros(2, nq, dtype=torch.bool)
    cover[:, 0] = diagonal_block
    cover[0, [2, 3, 5]] = True
    cover[1, 1] = True
    blocks = torch.randint(-1, nq, (2, nq, 2), generator=gen)
    columns = torch.randperm(n, generator=gen)[:90].view(2, 45)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for h in (2, 1, 1))
    _assert_kernel_matches_index(device, n, block, cover, blocks, columns, q, k, v)


def test_column_chunks_clear_of_walked_and_listed_blocks_take_the_unmasked_step(
    device, load_path, column_blocks
):
    """Long column lists well before the late query blocks: most chunks of 16 columns lie wholly
    before the block, off every walked diagonal and listed block (the mask-free step), others meet
    a diagonal run, a listed block or the causal edge (masked), in the same program."""
    n, block, nq = 320, 16, 20
    cover = torch.zeros(2, nq, dtype=torch.bool)
    cover[:, :2] = True  # the diagonal block and the one before it
    cover[1, 9:11] = True  # and, for head 1, a run 9-10 blocks back
    blocks = torch.full((2, nq, 1), -1)
    blocks[0, 5:, 0] = torch.arange(nq - 5)  # head 0 lists the block 5 back
    columns = torch.stack([torch.arange(0, 256, 2)[:100], torch.arange(0, 300, 3)])  # 100 each
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for h in (2, 1, 1))
    _assert_kernel_matches_index(device, n, block, cover, blocks, columns, q, k, v)


@pytest.mark.parametrize("bits", [True, False], ids=["tests-up-front", "tests-in-loop"])
def test_columns_alone_reach_up_to_each_row(device, load_path, column_blocks, bits, monkeypatch):
    """Every key a column, nothing walked or listed: plain causal attention. Chunks inside the
    query block's own keys are clear of every diagonal and differ from a mask-free chunk only by
    the causal edge. Pass 2 tests the chunks before its loop (as bits) or, with more chunks than
    that takes, one at a time inside it."""
    from tgserve.kernels.sparse import kernel

    if not bits:
        monkeypatch.setattr(kernel, "CLEAN_BITS_CHUNKS", 2)
    n, block, nq = 150, 16, 10
    cover = torch.zeros(2, nq, dtype=torch.bool)
    columns = torch.arange(n).expand(2, n)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for h in (2, 1, 1))
    _assert_kernel_matches_index(device, n, block, cover, None, columns, q, k, v)


class _SmallSharedMemory:
    """A kernel as a GPU with less shared memory than an H200 sees it: launches of more than
    `max_stages` pipeline stages fail to load with Triton's OutOfResources, before running."""

    def __init__(self, kernel, max_stages: int, tried: list):
        self.kernel, self.max_stages, self.tried = kernel, max_stages, tried

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tried.append((kwargs["num_warps"], kwargs["num_stages"]))
            if kwargs["num_stages"] > self.max_stages:
                raise OutOfResources(232448, 101376, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_sparse_kernel_takes_smaller_launches_where_shared_memory_is_short(device, monkeypatch):
    """The walk's and pass 2's tuned launches refused (as on an Ada GPU): the first smaller launch that
    loads runs, the output is unchanged, and the next call starts from it."""
    from tgserve.kernels import triton_common
    from tgserve.kernels.sparse import kernel

    monkeypatch.setattr(triton_common, "_fitting_launch", {})
    walk_tried, scattered_tried = [], []
    monkeypatch.setattr(kernel, "_walk_kernel", _SmallSharedMemory(kernel._walk_kernel, 1, walk_tried))
    monkeypatch.setattr(
        kernel, "_scattered_kernel", _SmallSharedMemory(kernel._scattered_kernel, 1, scattered_tried)
    )
    n, block = 150, 16
    q, k, v = _qkv(n, 8, 2, 32, torch.float32, seed=7)
    index = estimate_index(q, k, 0.2, MIXED * 2, block, last_q=16)
    want = reference.masked_attention(q, k, v, index_to_mask(index), 0.2)
    moved = estimate_index(q.to(device), k.to(device), 0.2, MIXED * 2, block, last_q=16)
    for _ in range(2):
        got = sparse_attention_kernel(q.to(device), k.to(device), v.to(device), moved, 0.2)
        assert max_abs_err(got.cpu(), want) <= ATOL[torch.float32]
    walk_fits, scattered_fits = kernel.WALK_FALLBACKS[-1], kernel.FALLBACKS[-1]
    # The second call went straight to the launch that fitted.
    assert walk_tried == _warps_stages(kernel.WALK_LAUNCH, *kernel.WALK_FALLBACKS, walk_fits)
    assert scattered_tried == _warps_stages(kernel.LAUNCH, scattered_fits, scattered_fits)


def _warps_stages(*launches: dict) -> list[tuple[int, int]]:
    return [(launch["num_warps"], launch["num_stages"]) for launch in launches]


def test_launch_fitting_raises_when_no_launch_fits(monkeypatch):
    from tgserve.kernels import triton_common

    monkeypatch.setattr(triton_common, "_fitting_launch", {})

    def refuse(launch):
        raise OutOfResources(232448, 101376, "shared memory")

    with pytest.raises(OutOfResources):
        triton_common.launch_fitting(
            "kernel", torch.device("cpu"), [{"num_stages": 3}, {"num_stages": 1}], refuse
        )
    assert triton_common._fitting_launch == {}


@pytest.mark.parametrize("n", [140, 150])  # 9 query blocks (the last program half past the end), 10
def test_walk_over_several_query_blocks(device, n, walk_qblocks, load_path):
    """Runs of one offset, long runs clamped at key block 0, runs starting past the first query
    block of a program, with and without the diagonal block: the walk's edge blocks reach only
    their own rows."""
    block = 16
    nq = -(-n // block)
    cover = torch.zeros(3, nq, dtype=torch.bool)
    cover[0, [0, 1, 3, 4, 5, 8]] = True  # runs 1, 3-5, 8
    cover[1, [2, 6]] = True  # two runs of one offset, no diagonal block
    cover[2, : nq - 1] = True  # one long run from offset 1 reaching key block 0
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for h in (3, 3, 3))
    _assert_kernel_matches_index(device, n, block, cover, None, None, q, k, v)
