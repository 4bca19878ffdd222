"""Rescue by key-block boxes (kernels/sparse/boxes.py, its Triton twin boxes_kernel.py): the boxes,
their bounds, and the picks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.boxes import bound_operands, box_rescue_blocks, key_boxes
from tgserve.kernels.sparse.boxes_kernel import box_rescue_blocks_triton, head_boxes
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.estimate import held_blocks
from tgserve.kernels.sparse.index import index_to_mask

BLOCK = 8


def direct_boxes(key, kv, columns, block):
    """Per block: the largest and smallest value of each coordinate over its keys less the columns."""
    n = key.shape[0]
    keep = torch.ones(n, dtype=torch.bool)
    keep[[c for c in columns.tolist() if 0 <= c < n]] = False
    mids, radii = [], []
    for start in range(0, n, block):
        keys = key[start : start + block, kv][keep[start : start + block]]
        if len(keys) == 0:
            mids.append(torch.zeros(key.shape[-1]))
            radii.append(torch.zeros(key.shape[-1]))
            continue
        high, low = keys.amax(0), keys.amin(0)
        mids.append((high + low) / 2)
        radii.append((high - low) / 2)
    return torch.stack(mids), torch.stack(radii)


def test_key_boxes_leave_out_each_heads_columns():
    """Boxes per query head of a group: its own columns out (a block of columns alone is empty),
    a partial last block of its own keys."""
    gen = torch.Generator().manual_seed(0)
    n, d = 8 * BLOCK + 3, 6
    key = torch.randn(n, 2, d, generator=gen)
    columns = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 20, -1], [70, 33, 34, -1, -1, -1, -1, -1, -1, -1]])
    mid, radius = key_boxes(key, [0, 1], columns, BLOCK)
    for s, kv in enumerate([0, 1]):
        want_mid, want_radius = direct_boxes(key, kv, columns[s], BLOCK)
        assert torch.allclose(mid[s], want_mid) and torch.allclose(radius[s], want_radius)
    assert mid[0, 0].abs().sum() == 0 and radius[0, 0].abs().sum() == 0  # block 0: columns alone


def test_box_bounds_are_at_least_every_product_they_bound():
    """Mean bound >= the mean query against any key of the block; range bound >= any query of
    the query block against any key of the key block (the head's columns left out of both)."""
    gen = torch.Generator().manual_seed(1)
    n, d = 6 * BLOCK, 5
    # Keys off the origin (|midpoint| > half-width) and queries spread (half-width > 0): every
    # term of the range bound counts.
    q, k = torch.randn(n, 1, d, generator=gen), torch.randn(n, 1, d, generator=gen) + 3.0
    columns = torch.tensor([[9, -1]])
    kept = torch.ones(n, dtype=torch.bool)
    kept[9] = False
    logits = (q[:, 0] @ k[:, 0].t()).masked_fill(~kept, float("-inf")).view(6, BLOCK, 6, BLOCK)
    mean = q[:, 0].view(-1, BLOCK, d).mean(1)
    pooled = (mean @ k[:, 0].t()).masked_fill(~kept, float("-inf")).view(6, 6, BLOCK).amax(-1)
    for query_range, bounded in ((False, pooled), (True, logits.amax(dim=(1, 3)))):
        queries, boxes = bound_operands(q, k, [0], BLOCK, columns, query_range)
        bound = queries[0] @ boxes[0].t()
        assert (bound >= bounded - 1e-5).all()


def test_the_range_bound_rescues_a_key_that_few_queries_seek():
    """A key that 2 of a block's 8 queries seek strongly: the range bound picks its block for that
    query block; no pick is held, after the query block, or past the budget."""
    gen = torch.Generator().manual_seed(2)
    n, d = 16 * BLOCK, 8
    q, k = 0.3 * torch.randn(n, 2, d, generator=gen), 0.3 * torch.randn(n, 1, d, generator=gen)
    needle, seekers = 3 * BLOCK + 5, [12 * BLOCK + 2, 12 * BLOCK + 3]
    k[needle, 0, 7] = 6.0
    q[seekers, :, 7] = 6.0
    nq = n // BLOCK
    cover = torch.zeros(2, nq, dtype=torch.bool)
    cover[:, 0] = True  # the diagonal block
    listed = torch.full((2, nq, 1), -1)
    listed[1, :, 0] = 0  # head 1 lists key block 0 everywhere
    picks = box_rescue_blocks(q, k, [0, 1], BLOCK, cover, listed, None, [2, 1], query_range=True)
    assert picks.shape == (2, nq, 2) and (picks[1, :, 1] == -1).all()
    assert (picks[:, 12] == 3).any(-1).all(), "the needle's block, for the seekers' query block"
    held = held_blocks(cover, listed)
    i = torch.arange(nq)[None, :, None]
    valid = picks >= 0
    assert (picks[valid] != i.expand_as(picks)[valid]).all() and (picks <= i).all()
    assert not held.gather(2, picks.clamp(min=0))[valid].any()


def test_heads_of_one_layer_may_score_against_keys_or_boxes():
    """Each head's rescue blocks are those of a layer whose heads all make its choice."""
    gen = torch.Generator().manual_seed(3)
    n, heads = 40 * BLOCK, 4
    q, k = torch.randn(n, heads, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    choices = ["keys", "range-boxes", "boxes", "keys"]
    base = HeadPattern("vertical_slash", vertical=8, slash=32, sink=4, local=8, rescue=3, rescue_range=1)
    mixed = index_to_mask(
        estimate_index(q, k, 0.25, [replace(base, rescue_against=c) for c in choices], BLOCK, 16)
    )
    for h, choice in enumerate(choices):
        alone = estimate_index(q, k, 0.25, [replace(base, rescue_against=choice)] * heads, BLOCK, 16)
        assert torch.equal(mixed[h], index_to_mask(alone)[h]), choice
    keys_only = index_to_mask(
        estimate_index(q, k, 0.25, [replace(base, rescue_against="keys")] * heads, BLOCK, 16)
    )
    assert not torch.equal(mixed[2], keys_only[2]), "boxes must pick differently here"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("query_range", [False, True], ids=["mean", "range"])
@pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
@pytest.mark.parametrize("budget", [[2, 2, 2, 2, 2], [1, 3, 2, 5, 1]])
def test_box_rescue_kernel_picks_the_twins_blocks(device, dtype, query_range, held, budget):
    """The Triton launch against the torch twin: 38 query blocks (three steps of 16 key blocks
    and three tiles under the interpreter), held diagonals, listed blocks and each head's columns
    left out of its boxes, budgets differing by head. fp16: both round the operands to fp16."""
    gen = torch.Generator().manual_seed(4)
    n, block = 300, 8
    q, k = torch.randn(n, 8, 32, generator=gen).to(dtype), torch.randn(n, 2, 32, generator=gen).to(dtype)
    heads, nq = [0, 1, 3, 5, 6] if held else [1, 2, 3, 4, 5], -(-n // block)
    cover = torch.rand(5, nq, generator=gen) < 0.3
    listed = torch.randint(-1, nq, (5, nq, 3), generator=gen) if held else None
    # Columns filling block 2 of head 0 (an empty box there), and scattered ones.
    columns = torch.cat([torch.arange(16, 24).expand(5, 8), torch.randint(-1, n, (5, 9), generator=gen)], 1)
    columns = columns if held else None
    want = box_rescue_blocks(q, k, heads, block, cover, listed, columns, budget, query_range)
    moved = [None if x is None else x.to(device) for x in (cover, listed, columns)]
    got = box_rescue_blocks_triton(q.to(device), k.to(device), heads, block, *moved, budget, query_range)
    assert torch.equal(got.cpu().sort(-1).values, want.sort(-1).values)


def test_head_boxes_are_the_twins_boxes_rounded(device):
    """Each listed head's boxes less its own columns, as `key_boxes` gives them, in the operands'
    type (a partial last block; several columns in one block, written by each column's program)."""
    gen = torch.Generator().manual_seed(5)
    n, d = 8 * BLOCK + 3, 32
    key = torch.randn(n, 2, d, generator=gen)
    columns = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 20, 66], [70, 33, 34, -1, -1, -1, -1, -1, -1, -1]])
    for dtype in (torch.float32, torch.float16):
        mid, radius = head_boxes(key.to(device), [0, 1], BLOCK, columns.to(device), dtype)
        want_mid, want_radius = key_boxes(key, [0, 1], columns, BLOCK)
        assert torch.equal(mid.cpu(), want_mid.to(dtype)) and torch.equal(radius.cpu(), want_radius.to(dtype))


def test_triton_estimation_against_boxes_gives_the_torch_index(device):
    """The whole estimation with heads scoring against keys, range-boxes and boxes in one layer:
    Triton and torch build the same mask."""
    gen = torch.Generator().manual_seed(6)
    n, heads = 40 * BLOCK, 4
    q, k = torch.randn(n, heads, 32, generator=gen), torch.randn(n, 2, 32, generator=gen)
    base = HeadPattern("vertical_slash", vertical=8, slash=32, sink=4, local=8, rescue=3, rescue_range=1)
    patterns = [replace(base, rescue_against=c) for c in ["keys", "range-boxes", "boxes", "range-boxes"]]
    want = index_to_mask(estimate_index(q, k, 0.25, patterns, BLOCK, 16))
    got = estimate_index(q.to(device), k.to(device), 0.25, patterns, BLOCK, 16, use_triton=True)
    assert torch.equal(index_to_mask(got).cpu(), want)
