"""Structured prompts, the MInference baseline and the sampled accuracy score: each checked against
a direct computation, so that the accuracy reports comparing them mean what they say."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tgserve.kernels import reference
from tgserve.kernels.sparse import minference_baseline as minference
from tgserve.kernels.sparse.accuracy import oracle, score
from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.estimate import band_scores
from tgserve.kernels.sparse.index import build_index, index_to_mask
from tgserve.kernels.sparse.shifted_bands import (
    BandedMasks,
    band_held,
    choose_bands,
    choose_mixed,
)
from tgserve.kernels.sparse.synthetic import STRUCTURES, Structure, structured_prompt

SMALL = Structure(seekers=(16, 64), depths=(0.25, 0.75))
PATTERN = HeadPattern(vertical=64, slash=256, sink=16, local=64, rescue=2, rescue_range=0)  # both by the mean


def _convert_one(
    verticals: list[int], offsets: list[int], end_m: int, b: int = 64
) -> tuple[list[int], list[int]]:
    """MInference's CUDA conversion for one (head, query block), step by step as written there:
    offsets descending, verticals ascending; returns (block starts, columns)."""
    blocks, cols = [], []
    v = s = 0

    def next_vertical() -> int:
        nonlocal v
        v += 1
        return verticals[v - 1] if v - 1 < len(verticals) else end_m + b

    v_idx = next_vertical()
    s_idx = offsets[0]
    s = 1
    while s_idx >= end_m and s < len(offsets):
        s_idx, s = offsets[s], s + 1
    s_idx = end_m + b if s_idx >= end_m else max(end_m - s_idx, b)
    start, end = s_idx - b, s_idx
    while True:
        if v_idx < end:
            if v_idx < start:
                cols.append(v_idx)
            v_idx = next_vertical()
            continue
        if s == len(offsets):
            blocks += list(range(start, end, b))
            return blocks, cols
        s_idx, s = max(end_m - offsets[s], b), s + 1
        if s_idx > end + b:
            blocks += list(range(start, end, b))
            start, end = s_idx - b, s_idx
        elif s_idx > end:
            end += b


def test_minference_ranges_and_tiles_match_its_conversion_step_by_step():
    gen = torch.Generator().manual_seed(0)
    n, heads = 1000, 3
    verticals = torch.stack([torch.randperm(n, generator=gen)[:40].sort().values for _ in range(heads)])
    offsets = []
    for _ in range(heads):
        far = torch.randperm(n - 100, generator=gen)[:60] + 100
        offsets.append(torch.cat([torch.arange(100), far]).sort(descending=True).values)
    index = minference.MInferenceIndex(seq_len=n, verticals=verticals, offsets=torch.stack(offsets))
    mask = minference.kept_mask(index, slice(0, n))
    tiles = minference.tiles_per_block(index)
    for h in range(heads):
        for qb in range(index.query_blocks()):
            end_m = (qb + 1) * 64
            blocks, cols = _convert_one(verticals[h].tolist(), offsets[h].tolist(), end_m)
            assert tiles[h, qb] == len(blocks) + math.ceil(len(cols) / 64), (h, qb)
            want = torch.zeros(n, dtype=torch.bool)
            for start in blocks:
                want[start : start + 64] = True
            want[cols] = True
            for p in range(qb * 64, min(n, end_m)):
                assert torch.equal(mask[h, p], want & (torch.arange(n) <= p)), (h, p)


def test_structured_prompt_plants_diagonals_and_needles():
    n = 4096
    prompt = structured_prompt(n, 4, 1, 128, seed=3, plant=SMALL)
    q, k = prompt.query[:, 0].double(), prompt.key[:, 0].double()
    rotary = 2 * ((128 - 2 - len(prompt.needles) - 4) // 2)
    logits = q[:, :rotary] @ k[:, :rotary].t()
    # The rotary part is a function of the offset only: every structure in it is a diagonal.
    torch.testing.assert_close(
        torch.diagonal(logits, -300)[:-1], torch.diagonal(logits, -300)[1:], atol=1e-6, rtol=1e-6
    )
    keys = {needle.key for needle in prompt.needles}
    assert len(keys) == len(prompt.needles), "one key per needle"
    for needle in prompt.needles:
        assert needle.key < needle.seekers.start and needle.seekers.stop <= n - 64
        share = []
        for p in (needle.seekers.start, needle.seekers.start - 1):  # a seeker, then the query before it
            probs = torch.softmax(
                (prompt.query[p].double() @ prompt.key[: p + 1, 0].double().t()) * prompt.scale, -1
            )
            share.append(probs[:, needle.key])
        assert (share[0] > 20 * share[1]).all(), (needle, share)


def test_sampled_score_of_every_block_is_the_exact_error():
    n = 1024
    prompt = structured_prompt(n, 4, 1, 128, seed=1, plant=SMALL)
    index = estimate_index(prompt.query, prompt.key, prompt.scale, [PATTERN] * 4)
    report = score(prompt, lambda rows: index_to_mask(index, rows), blocks=n // 64)
    causal = reference.causal_mask(n, n)
    dense = reference.masked_attention(prompt.query, prompt.key, prompt.value, causal, prompt.scale)
    sparse = reference.masked_attention(
        prompt.query, prompt.key, prompt.value, index_to_mask(index), prompt.scale
    )
    want = ((sparse - dense).double().norm() / dense.double().norm()).item()
    assert 0 < want and math.isclose(report.rel_l2, want, rel_tol=1e-4), (report.rel_l2, want)


# Rotated, the range bound's mean recall here: against keys 0.70, against boxes 0.49 (a box, per
# coordinate, is looser still when no feature has a coordinate of its own). Over seeds 3-5 and the
# three families boxes recalled less in 7 of 9 prompts yet kept 12 needles whole against keys' 10.
ROTATED_FLOOR = {"keys": 0.5, "range-boxes": 0.4}


@pytest.mark.parametrize("family", ["rope", "sharp", "rope-10k"])
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("against", ["keys", "range-boxes"])
def test_rescue_by_query_range_keeps_needles_that_16_queries_seek(family, rotated, against):
    """A key only 16 queries seek: the block-mean query dilutes its logit four times and the rescue
    misses it; the query block's range bound (`rescue_range`) keeps it, scored against keys or
    against key-block boxes. Rotated (q and k by one random orthogonal matrix: the same attention,
    no feature on a coordinate of its own) the bound is looser and keeps less, still far more than
    the mean."""
    n = 8192
    prompt = structured_prompt(n, 4, 1, 128, seed=3, plant=replace(STRUCTURES[family], seekers=(16,)))
    if rotated:
        gen = torch.Generator().manual_seed(7)
        rotation = torch.linalg.qr(torch.randn(128, 128, generator=gen, dtype=torch.float64))[0].float()
        prompt = replace(prompt, query=prompt.query @ rotation, key=prompt.key @ rotation)
    recalls = []
    for pattern in (PATTERN, replace(PATTERN, rescue_range=1, rescue_against=against)):
        index = estimate_index(prompt.query, prompt.key, prompt.scale, [pattern] * 4)
        report = score(prompt, lambda rows, index=index: index_to_mask(index, rows), blocks=2)
        recalls.append(torch.tensor([recall for *_, recall, _ in report.needles]))
    by_mean, by_range = recalls
    assert len(by_mean) == 5 and (by_mean >= 0.9).sum() <= 1
    if rotated:
        assert by_range.mean() >= max(ROTATED_FLOOR[against], 2 * by_mean.mean()), (by_mean, by_range)
    else:
        assert (by_range >= 0.9).all(), by_range


def test_block_oracle_keeps_at_least_the_mass_of_any_block_choice_at_its_cost():
    n = 2048
    prompt = structured_prompt(n, 4, 1, 128, seed=2, plant=replace(STRUCTURES["rope"], seekers=()))
    blocks_only = HeadPattern(kind="block_sparse", blocks=6, rescue=0)
    index = estimate_index(prompt.query, prompt.key, prompt.scale, [blocks_only] * 4)
    ours = score(prompt, lambda rows: index_to_mask(index, rows), blocks=8)
    best = score(prompt, oracle(prompt, index.tiles_per_block()), blocks=8)
    assert best.mass >= ours.mass - 1e-6 and ours.mass < 1.0


def test_bands_keep_the_keys_of_their_shifts_and_hold_only_whole_blocks():
    """A band at shift s keeps keys q0 - s .. q0 - s + 63 of the query block at q0 (so diagonal s
    whole, for every row, in one tile); blocks count as held only when bands cover all of them."""
    n, b = 768, 64
    bands = torch.tensor([[0, 64, 200, 264, -1], [0, 64, 128, 500, 7]])
    masks = BandedMasks(bands, build_index(n, b, torch.zeros(2, n // b, dtype=torch.bool), None, None))
    rows = slice(128, 300)
    want = torch.zeros(2, rows.stop - rows.start, n, dtype=torch.bool)
    for h, shifts in enumerate(bands.tolist()):
        for i, q in enumerate(range(rows.start, rows.stop)):
            for s in (s for s in shifts if s >= 0):
                start = q // b * b - s
                want[h, i, max(0, start) : max(0, min(q + 1, start + b))] = True
    assert torch.equal(masks(rows), want)
    held = band_held(bands, n // b, b)
    # Query block 10 (keys from 640): 0 and 64 hold blocks 10 and 9; 200 and 264 together hold
    # keys 376..503, so block 6 whole and parts of 5 and 7.
    assert held[0, 10].nonzero().flatten().tolist() == [6, 9, 10]


def test_bands_centre_on_isolated_diagonals_off_the_block_grid():
    n, b = 4096, 64
    scores = torch.zeros(1, n)
    scores[0, [700, 1333, 2900]] = torch.tensor([3.0, 2.0, 1.0])
    picked = choose_bands(band_scores(scores, b), budget=5, forced=2, block=b)
    assert picked[0].tolist() == [0, 64, 700, 1333, 2900]


def test_mixed_bands_shift_isolated_peaks_and_leave_runs_aligned():
    n, b = 4096, 64
    scores = torch.zeros(1, n)
    scores[0, [700, 1333, 2900]] = torch.tensor([3.0, 2.0, 1.0])
    scores[0, 2000:2400] = 0.05  # a plateau: a run of aligned block diagonals
    picked = choose_mixed(band_scores(scores, b), budget=14, forced=2, block=b)[0].tolist()
    assert {700, 1333, 2900} <= set(picked)  # one tile each, centred, instead of two aligned
    assert {1984, 2048, 2112, 2176, 2240, 2304, 2368} <= set(picked)
    assert len(set(picked)) == 14 and all(abs(x - y) >= b for x, y in zip(sorted(picked), sorted(picked)[1:]))
