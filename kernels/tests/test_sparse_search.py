"""Per-model pattern search (`kernels.sparse.search`): each head gets the candidate that keeps the
most of its attention, and what it writes loads back as those patterns."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels.sparse.config import parse_sparse_config
from tgserve.kernels.sparse.search import candidate_patterns, config_json, kept_mass, search_layer
from tgserve.kernels.sparse.synthetic import Planted, planted_prompt

N, BLOCK, LAST_Q, BUDGET = 2048, 32, 32, 256


@pytest.fixture(scope="module")
def planted():
    # Periodic diagonals far from the main one and heavy hitters scattered over the prompt: a sink
    # and a local window (A-shape) miss both.
    return planted_prompt(N, 4, 2, 64, seed=3, plant=Planted(period_frac=1 / 5, heavy_hitters=16))


def test_each_head_takes_the_candidate_that_keeps_the_most(planted):
    choices = search_layer(planted.query, planted.key, planted.scale, BUDGET, BLOCK, LAST_Q)
    masses = torch.stack([
        kept_mass(planted.query, planted.key, planted.scale, p, BLOCK, LAST_Q) for p in candidate_patterns(BUDGET, BLOCK)
    ])  # fmt: skip
    for head, choice in enumerate(choices):
        assert choice.mass == pytest.approx(masses[:, head].max().item())
        assert choice.pattern.kind != "a_shape"
        a_shape = masses[0, head].item()  # the first candidate
        assert choice.mass > a_shape + 0.05, (choice, a_shape)


def test_a_budget_past_the_prompt_keeps_everything(planted):
    n = 512
    short = planted_prompt(n, 2, 1, 64, seed=4)
    for choice in search_layer(short.query, short.key, short.scale, 4 * n, BLOCK, LAST_Q):
        assert choice.mass == pytest.approx(1.0, abs=1e-5)


def test_the_written_config_loads_back_as_the_chosen_patterns(planted):
    choices = search_layer(planted.query, planted.key, planted.scale, BUDGET, BLOCK, LAST_Q)
    data = config_json({0: choices, 3: choices}, 8192, BLOCK, LAST_Q, {"tokens": N, "budget": BUDGET})
    config = parse_sparse_config(data)
    assert config.block == BLOCK and config.last_q == LAST_Q and config.min_seq_len == 8192
    for layer in (0, 3):
        assert config.head_patterns(layer, 4) == [c.pattern for c in choices]
    assert data["search"]["mass"]["3"]["1"][0] == round(choices[1].mass, 4)
