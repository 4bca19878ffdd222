"""Sampler tests: parity with transformers' processors, seeded determinism, and sampling frequencies."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgserve.server.protocol.params import SamplingParams
from tgserve.server.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    min_p_filter,
    row_seed,
    temperature_warp,
    top_k_filter,
    top_p_filter,
    typical_p_filter,
    warp,
)

V = 64


def row(step: int = 0, prompt: list[int] | None = None, output: list[int] | None = None, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), prompt or [], output or [], step)


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_for_any_dtype() -> None:
    logits = rand_logits(5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = Sampler()(logits.to(dtype), [row(temperature=0.0) for _ in range(5)])
        assert out.token_ids.dtype == torch.int64
        assert torch.equal(out.token_ids, logits.to(dtype).argmax(-1))
        assert out.logprobs == [None] * 5


def test_slow_path_leaves_the_callers_logits_alone() -> None:
    logits = rand_logits(2)
    before = logits.clone()
    Sampler()(logits, [row(temperature=0.0, logit_bias={3: 50.0}, repetition_penalty=2.0, prompt=[1, 2])] * 2)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    ("ours", "theirs", "values"),
    [
        (temperature_warp, lambda v: TemperatureLogitsWarper(v), [0.3, 0.7, 1.5, 2.0]),
        (top_k_filter, lambda v: TopKLogitsWarper(v), [1, 5, 40, 1000]),
        (top_p_filter, lambda v: TopPLogitsWarper(v), [0.05, 0.5, 0.9, 0.99]),
        (min_p_filter, lambda v: MinPLogitsWarper(v), [0.01, 0.1, 0.5, 1.0]),
        (typical_p_filter, lambda v: TypicalLogitsWarper(v), [0.1, 0.5, 0.9, 0.99]),
    ],
)
def test_warper_matches_transformers(ours, theirs, values) -> None:
    # One row per value in the same batch, so per-row parameters must not leak between rows.
    logits = rand_logits(len(values), seed=1)
    got = ours(logits, values)
    for i, value in enumerate(values):
        expected = theirs(value)(None, logits[i : i + 1])
        assert torch.equal(got[i : i + 1], expected), f"row {i} ({value})"
    assert not torch.equal(got, logits), "the warper should have changed something"


def test_warp_chain_matches_transformers_in_its_order() -> None:
    combos = [
        dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95),
        dict(temperature=1.3, top_p=0.8, typical_p=0.7),
        dict(temperature=0.5, min_p=0.2),
        dict(min_p=0.05, typical_p=0.9),  # a row where min-p and typical-p do not commute
        dict(),
    ]
    logits = rand_logits(len(combos), seed=2)
    swapped = min_p_filter(typical_p_filter(logits[3:4], [0.9]), [0.05])
    assert not torch.equal(swapped, typical_p_filter(min_p_filter(logits[3:4], [0.05]), [0.9]))
    got = warp(logits, [SamplingParams(**c) for c in combos])
    for i, c in enumerate(combos):
        p = SamplingParams(**c)
        chain = LogitsProcessorList()
        chain.append(TemperatureLogitsWarper(p.temperature)) if p.temperature != 1.0 else None
        chain.append(TopKLogitsWarper(p.top_k)) if p.top_k else None
        chain.append(TopPLogitsWarper(p.top_p)) if p.top_p < 1.0 else None
        chain.append(MinPLogitsWarper(p.min_p)) if p.min_p > 0.0 else None
        chain.append(TypicalLogitsWarper(p.typical_p)) if p.typical_p < 1.0 else None
        assert torch.equal(
            got[i : i + 1], chain(torch.zeros(1, 0, dtype=torch.long), logits[i : i + 1].clone())
        )


def test_repetition_penalty_matches_transformers() -> None:
    logits = rand_logits(3, seed=3)
    rows = [
        row(prompt=[1, 2, 3], output=[5, 5, 9], repetition_penalty=1.3),
        row(prompt=[4, 60], output=[], repetition_penalty=0.7),
        row(prompt=[1, 2, 3], output=[7]),  # no penalty: must stay as is
    ]
    got = apply_penalties(logits.clone(), rows)
    for i, r in enumerate(rows):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        expected = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(
            ids, logits[i : i + 1].clone()
        )
        assert torch.equal(got[i : i + 1], expected)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])


def test_frequency_and_presence_penalties_count_output_only() -> None:
    logits = rand_logits(1, seed=4)
    r = row(prompt=[10, 11], output=[3, 3, 3, 7], frequency_penalty=0.5, presence_penalty=1.5)
    got = apply_penalties(logits.clone(), [r])[0]
    expected = logits[0].clone()
    expected[3] -= 0.5 * 3 + 1.5
    expected[7] -= 0.5 * 1 + 1.5
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert got[10] == logits[0, 10], "prompt tokens are not penalized by OpenAI penalties"


def test_penalty_changes_the_greedy_choice() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    out = Sampler()(logits, [row(temperature=0.0, output=[5, 5], frequency_penalty=1.0)])
    assert out.token_ids.tolist() == [6]


def _seeded_token(batch: list[SamplingRow], logits: torch.Tensor) -> list[int]:
    return Sampler()(logits, batch).token_ids.tolist()


def test_seeded_row_is_independent_of_its_batch() -> None:
    target = rand_logits(1, seed=5, scale=0.5)  # flat-ish, so the draw really depends on the noise
    for step in range(10):
        me = row(step=step, seed=1234, temperature=0.9, top_p=0.95, top_k=50)
        others = [
            row(temperature=0.0),
            row(temperature=1.0),
            row(seed=7, step=step, top_k=3),
            row(temperature=0.5, min_p=0.1, logprobs=2, repetition_penalty=1.2, prompt=[1, 2]),
            row(seed=99, typical_p=0.5),
        ]
        alone = _seeded_token([me], target)[0]
        for before, after in [([], others), (others, []), (others[:2], others[2:]), (others[3:], others[:1])]:
            batch = before + [me] + after
            logits = torch.cat(
                [rand_logits(len(before), seed=step + 10), target, rand_logits(len(after), seed=step)]
            )
            assert _seeded_token(batch, logits)[len(before)] == alone, (step, len(before), len(after))


def test_seeds_and_steps_change_the_draw() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any repeat would be a 1-in-1000 coincidence
    by_seed = {s: tuple(_seeded_token([row(step=t, seed=s)], logits)[0] for t in range(6)) for s in range(8)}
    assert len(set(by_seed.values())) == 8
    assert all(len(set(seq)) >= 5 for seq in by_seed.values())
    assert row_seed(1, 2) != row_seed(2, 1) and row_seed(0, 0) != row_seed(0, 1)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 99.9th percentiles of chi-square with df degrees of freedom.
_CHI2_999 = {2: 13.82, 5: 20.52}


def test_temperature_sampling_frequencies_match_softmax() -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.3])
    n = 20000
    torch.manual_seed(0)
    unseeded = Sampler()(base.expand(n, -1), [row(temperature=0.7)] * n).token_ids
    assert _chi_square(unseeded, torch.softmax(base / 0.7, -1)) < _CHI2_999[5]
    seeded = Sampler()(
        base.expand(4000, -1), [row(step=t, seed=3, temperature=0.7) for t in range(4000)]
    ).token_ids
    assert _chi_square(seeded, torch.softmax(base / 0.7, -1)) < _CHI2_999[5]


def test_warped_sampling_frequencies_match_the_warped_distribution() -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.3])
    torch.manual_seed(1)
    tokens = Sampler()(base.expand(20000, -1), [row(temperature=1.2, top_k=3)] * 20000).token_ids
    warped = TopKLogitsWarper(3)(None, TemperatureLogitsWarper(1.2)(None, base[None].clone()))
    assert _chi_square(tokens, torch.softmax(warped[0], -1)) < _CHI2_999[2]


def test_top_k_one_is_greedy() -> None:
    logits = rand_logits(50, seed=6, scale=0.1)
    rows = [row(step=i, seed=i, temperature=5.0, top_k=1) for i in range(50)]
    assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_take_the_argmax() -> None:
    logits = rand_logits(6, seed=7)
    rows = [row(temperature=0.0 if i % 2 else 2.0, seed=i) for i in range(6)]
    out = Sampler()(logits, rows).token_ids
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


def test_logprobs_are_the_raw_distribution_best_first() -> None:
    logits = rand_logits(3, seed=8)
    rows = [
        row(temperature=2.0, seed=1, logprobs=4, logit_bias={0: 5.0}),
        row(temperature=0.0),
        row(temperature=0.0, logprobs=0, repetition_penalty=1.5, prompt=[int(logits[2].argmax())]),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, -1)
    first, second, third = out.logprobs
    assert second is None
    assert first.token_id == out.token_ids[0].item()
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-6)
    expected_top = torch.topk(raw[0], 4)
    assert [t for t, _ in first.top] == expected_top.indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(expected_top.values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(first.top, first.top[1:], strict=False))
    assert third.top == [] and third.logprob == pytest.approx(raw[2, third.token_id].item(), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens(temperature: float) -> None:
    logits = rand_logits(4, seed=9)
    forced = Sampler()(
        logits, [row(step=i, seed=i, temperature=temperature, logit_bias={17: 100.0}) for i in range(4)]
    )
    assert forced.token_ids.tolist() == [17] * 4
    best = logits.argmax(-1).tolist()
    banned = Sampler()(logits, [row(temperature=0.0, logit_bias={b: -100.0}) for b in best])
    assert all(t != b for t, b in zip(banned.token_ids.tolist(), best, strict=True))


# Parameters the APIs accept whose float32 arithmetic overflows: a temperature below float32's
# smallest normal (0 once converted) or past its largest (TGI sets no maximum), a repetition penalty
# near 0. Each once made every score nan, and argmax then took token 0 whatever the mask allowed.
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 5e-324},
        {"temperature": 1e-40},
        {"temperature": 1e300},
        {"temperature": 1e38},
        {"temperature": 1.0, "repetition_penalty": 1e-300},
        {"temperature": 0.5, "repetition_penalty": 1e-36},
        {"temperature": 1.0, "repetition_penalty": 1e300},
    ],
)
def test_extreme_parameters_sample_only_allowed_tokens(params) -> None:
    from tgserve.server.sampling.guided import TokenMask

    allowed = [35, 37]
    bits = torch.zeros(1, V // 32, dtype=torch.int32)
    bits[0, 1] = (1 << 3) | (1 << 5)
    mask = TokenMask([0], bits)
    sampler = Sampler()
    for step in range(8):
        # Token 35 was seen: a repetition penalty works on it.
        out = sampler(rand_logits(1, seed=step), [row(step, prompt=[1, 35], seed=7, **params)], mask)
        assert out.token_ids.item() in allowed, (params, step)


def test_temperatures_below_the_threshold_are_greedy() -> None:
    from tgserve.server.protocol.params import GREEDY_BELOW_TEMPERATURE

    logits = rand_logits(4)
    rows = [row(temperature=t, seed=3) for t in (5e-324, 1e-40, 1e-9, GREEDY_BELOW_TEMPERATURE / 2)]
    assert all(r.params.greedy for r in rows)
    assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(-1))
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).greedy
