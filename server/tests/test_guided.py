"""Guided decoding's parts on the tiny fixtures' tokenizer: the grammar check the router and engine
share, the matchers and their masks, the mask in the sampler."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from tgserve.server.core.request import FinishReason
from tgserve.server.protocol.grammar import check_grammar
from tgserve.server.protocol.params import GuidedDecoding, InvalidRequestError, SamplingParams
from tgserve.server.sampling.guided import GuidedMatchers, TokenMask, allowed_tokens, apply_token_mask
from tgserve.server.sampling.sampler import Sampler, SamplingRow
from tgserve.server.testing.fixtures import fixture_path

VOCAB = 768


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(fixture_path("llama"))


@pytest.fixture(params=["llguidance", "xgrammar"])
def matchers(request, tokenizer) -> GuidedMatchers:
    return GuidedMatchers(lambda: (tokenizer, {tokenizer.eos_token_id}), VOCAB, request.param)


def allowed_ids(matchers: GuidedMatchers, request_ids: list[str], row: int = 0) -> list[int]:
    mask = matchers.mask(request_ids, torch.zeros(len(request_ids), VOCAB))
    return torch.nonzero(allowed_tokens(mask.bits, VOCAB)[row]).flatten().tolist()


def completing(matchers: GuidedMatchers, request_id: str, token: int, eos: int) -> FinishReason | None:
    """The request's finish reason once `token` completes its grammar: llguidance ends the request
    on that token; xgrammar then allows the end token alone, and ends the request on it."""
    reason = matchers.consume(request_id, token)
    if matchers._backend_name == "xgrammar":
        assert reason is None and allowed_ids(matchers, [request_id]) == [eos]
        reason = matchers.consume(request_id, eos)
    return reason


# ---- the grammar check -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("lark", "start: /a/", "kind must be one of"),
        ("regex", "", "regular expression is empty"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "object or a boolean"),
    ],
)
def test_guided_decoding_checks_its_fields(kind: str, text: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        GuidedDecoding(kind, text)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GuidedDecoding("regex", "(("), "regular expression cannot be used.*unclosed group"),
        (GuidedDecoding("json_schema", '{"type": "nope"}'), "JSON schema cannot be used.*nope"),
        (GuidedDecoding("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (GuidedDecoding("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}'), "minimum"),
        (GuidedDecoding("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
    ],
)
def test_a_grammar_that_cannot_be_used_is_named(spec: GuidedDecoding, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        check_grammar(spec)
    assert "\n" not in str(caught.value)


def test_usable_grammars_pass_the_check() -> None:
    for spec in (
        GuidedDecoding("json_object"),
        GuidedDecoding("regex", r"\d{3}-[a-z]+"),
        GuidedDecoding("json_schema", '{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}}'),
    ):
        assert check_grammar(spec)


def test_sampling_params_carry_the_grammar_through_copies() -> None:
    import dataclasses

    params = SamplingParams(guided=GuidedDecoding("regex", "a+"))
    assert dataclasses.replace(params, seed=3).guided == GuidedDecoding("regex", "a+")


# ---- matchers and masks ------------------------------------------------------------------------


def test_the_mask_allows_what_the_grammar_allows_and_the_end_comes_with_it(matchers, tokenizer) -> None:
    matchers.add("r", GuidedDecoding("regex", r"[0-9]{3}"))
    first = allowed_ids(matchers, ["r"])
    texts = [tokenizer.decode([t]) for t in first]
    assert texts and all(re.fullmatch(r"[0-9]{1,3}", text) for text in texts), texts
    assert tokenizer.eos_token_id not in first
    digits = tokenizer.encode("123")
    for token in digits[:-1]:
        assert matchers.consume("r", token) is None
    # The grammar is complete on the last digit: nothing but the end may follow.
    assert completing(matchers, "r", digits[-1], tokenizer.eos_token_id) == FinishReason.EOS_TOKEN


def test_an_accepting_grammar_lets_the_end_token_through(matchers, tokenizer) -> None:
    matchers.add("r", GuidedDecoding("regex", r"[0-9]+"))
    assert matchers.consume("r", tokenizer.encode("7")[0]) is None
    allowed = allowed_ids(matchers, ["r"])
    assert tokenizer.eos_token_id in allowed and tokenizer.encode("8")[0] in allowed
    assert tokenizer.encode("a")[0] not in allowed


def test_masks_come_in_the_rows_of_the_guided_requests_only(matchers, tokenizer) -> None:
    matchers.add("json", GuidedDecoding("json_object"))
    matchers.add("digits", GuidedDecoding("regex", r"[0-9]+"))
    mask = matchers.mask(["plain", "json", "other", "digits"], torch.zeros(4, VOCAB))
    assert mask.rows == [1, 3]
    allowed = allowed_tokens(mask.bits, VOCAB)
    assert tokenizer.encode("{")[0] in torch.nonzero(allowed[0]).flatten().tolist()
    assert not allowed[0, tokenizer.encode("1")[0]] and allowed[1, tokenizer.encode("1")[0]]
    assert matchers.mask(["plain", "other"], torch.zeros(2, VOCAB)) is None


def test_a_late_mask_is_reported_then_used_once_ready(matchers, monkeypatch) -> None:
    """`start_masks` / `gather`: a row whose job is not done within the grace after the logits is
    late (its request named), the others come masked; the late job's mask serves the request's
    next step unchanged (its grammar has not moved), and with no grace every mask is waited for."""
    import threading

    matchers.add("slow", GuidedDecoding("regex", r"[0-9]+"))
    matchers.add("quick", GuidedDecoding("regex", r"[a-z]+"))
    want = matchers.mask(["slow", "quick"], torch.zeros(2, VOCAB))
    release = threading.Event()
    fill = matchers._fill

    def held(requests, bits):
        if requests[0] is matchers._requests["slow"]:
            release.wait(5)
        return fill(requests, bits)

    monkeypatch.setattr(matchers, "_fill", held)
    step = matchers.start_masks(["plain", "slow", "quick"], VOCAB)
    (rows, bits), late = step.gather(lambda: True, grace_s=0.05)
    assert rows == [2] and late == {"slow"}
    assert torch.equal(torch.from_numpy(bits[0]), want.bits[1])
    release.set()
    step = matchers.start_masks(["slow", "quick"], VOCAB)  # the same point of both grammars
    (rows, bits), late = step.gather(lambda: True, grace_s=None)
    assert rows == [0, 1] and late == set() and torch.equal(torch.from_numpy(bits), want.bits)


def test_requests_share_a_job_once_a_mask_of_their_own_came_in_time(matchers, tokenizer, monkeypatch) -> None:
    """New requests are filled alone (first masks are the likeliest to be slow: the grammar library
    builds its states); one late is not left alone for good: once a mask of its own job comes in
    time (and quick), it shares the step's job. Requests late while sharing are filled alone again
    until then."""
    import threading

    from tgserve.server.sampling import guided

    monkeypatch.setattr(guided, "QUICK_MASK_S", 5.0)  # the policy, not this host's speed
    ids = ["a", "b", "c"]
    for request_id in ids:
        matchers.add(request_id, GuidedDecoding("regex", r"[0-9]+"))
    one = tokenizer.encode("1")[0]
    release, fill = threading.Event(), matchers._fill

    def held(requests, bits):
        release.wait(5)
        return fill(requests, bits)

    monkeypatch.setattr(matchers, "_fill", held)

    def next_step(consume: bool = True):
        if consume:
            matchers.consume_step(dict.fromkeys(ids, one))
        step = matchers.start_masks(ids, VOCAB)
        return step, len({id(job) for job, _ in step._placed})

    step, jobs = next_step(consume=False)
    assert jobs == 3 and step.gather(lambda: True, grace_s=0.02) == (None, set(ids))
    release.set()
    step, jobs = next_step(consume=False)  # the late jobs, reused: in time now, but they were late
    assert jobs == 3 and step.gather(lambda: True, grace_s=None)[1] == set()
    step, jobs = next_step()
    assert jobs == 3  # none in time yet: each alone
    step.gather(lambda: True, grace_s=None)
    step, jobs = next_step()
    assert jobs == 1  # in time: one job for all
    release.clear()
    assert step.gather(lambda: True, grace_s=0.02)[1] == set(ids)  # late while sharing
    release.set()
    step.gather(lambda: True, grace_s=None)
    step, jobs = next_step()
    assert jobs == 3  # alone again
    step.gather(lambda: True, grace_s=None)
    assert next_step()[1] == 1  # and sharing once in time


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_masks_filled_into_pinned_rows_are_those_of_plain_arrays(tokenizer) -> None:
    """On CUDA the masks are filled into pinned arrays taken in turn (`PinnedMaskRows`): the same
    bits as plain arrays, each step's rows zeroed whatever an earlier step left there."""
    load = lambda: (tokenizer, {tokenizer.eos_token_id})  # noqa: E731
    plain, pinned = GuidedMatchers(load, VOCAB), GuidedMatchers(load, VOCAB, pinned=True)
    for matchers in (plain, pinned):
        matchers.add("json", GuidedDecoding("json_object"))
        matchers.add("digits", GuidedDecoding("regex", r"[0-9]+"))
    for ids in (["json", "digits"], ["digits"], ["json", "x", "digits"], ["json"]):
        want, got = (
            plain.mask(ids, torch.zeros(len(ids), VOCAB)),
            pinned.mask(ids, torch.zeros(len(ids), VOCAB, device="cuda")),
        )
        assert got.rows == want.rows and torch.equal(got.bits.cpu(), want.bits)


def test_a_request_coming_back_from_preemption_resumes_its_grammar(matchers, tokenizer) -> None:
    spec = GuidedDecoding("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    output = tokenizer.encode('{"a": 1')
    matchers.add("stepwise", spec)
    for token in output:
        assert matchers.consume("stepwise", token) is None
    matchers.add("rebuilt", spec, output)
    assert allowed_ids(matchers, ["stepwise"]) == allowed_ids(matchers, ["rebuilt"])
    # One that has seen the output stays as it is; one that has not is built again from it.
    matchers.add("stepwise", spec, output)
    matchers.add("rebuilt", spec, output + [tokenizer.encode(",")[0]])
    assert allowed_ids(matchers, ["stepwise"]) != allowed_ids(matchers, ["rebuilt"])
    closing = tokenizer.encode("}")[0]
    assert completing(matchers, "stepwise", closing, tokenizer.eos_token_id) == FinishReason.EOS_TOKEN


def test_a_grammar_that_does_not_compile_ends_its_request_on_the_end_token(matchers, tokenizer) -> None:
    matchers.add("bad", GuidedDecoding("regex", "(("))  # what the engine's check would have refused
    assert allowed_ids(matchers, ["bad"]) == [tokenizer.eos_token_id]
    assert matchers.consume("bad", tokenizer.eos_token_id) == FinishReason.GRAMMAR_ERROR


def test_without_a_tokenizer_guided_requests_end_with_a_grammar_error() -> None:
    matchers = GuidedMatchers(None, VOCAB)
    matchers.add("r", GuidedDecoding("regex", "a+"))
    assert matchers.mask(["r"], torch.zeros(1, VOCAB)) is not None
    assert matchers.consume("r", 5) == FinishReason.GRAMMAR_ERROR


def test_a_tokenizer_that_cannot_be_bridged_is_tried_once() -> None:
    calls = []

    def load():
        calls.append(1)
        return object(), [0]  # not a tokenizer at all: building the bridge fails

    matchers = GuidedMatchers(load, VOCAB)
    for request_id in ("a", "b"):
        matchers.add(request_id, GuidedDecoding("regex", "a+"))
        assert matchers.consume(request_id, 5) == FinishReason.GRAMMAR_ERROR
    assert len(calls) == 1


def test_a_token_the_grammar_refuses_ends_the_request(matchers, tokenizer) -> None:
    matchers.add("r", GuidedDecoding("regex", "[0-9]+"))
    assert matchers.consume("r", tokenizer.encode("a")[0]) == FinishReason.GRAMMAR_ERROR


# ---- the mask in the sampler -------------------------------------------------------------------


def test_apply_token_mask_sets_disallowed_logits_of_masked_rows_only() -> None:
    logits = torch.randn(3, 70)
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 0] = 0b101  # tokens 0 and 2
    bits[0, 1] = -(2**31)  # token 63 (the sign bit)
    masked = apply_token_mask(logits.clone(), TokenMask([1], bits))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.nonzero(masked[1].isfinite()).flatten().tolist() == [0, 2, 63]  # 64.. are past the mask
    assert torch.equal(masked[1, [0, 2, 63]], logits[1, [0, 2, 63]])


def test_the_sampler_picks_only_allowed_tokens_and_leaves_other_rows_as_they_were() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    allowed = [11, 500, 767]
    bits = torch.zeros(2, VOCAB // 32, dtype=torch.int32)
    for row in range(2):
        for token in allowed:
            bits[row, token // 32] |= 1 << (token % 32)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=1.0, seed=5, top_p=0.9),
        SamplingParams(temperature=1.5, seed=6, top_k=50),
    ]
    rows = [SamplingRow(p, [], [], step=3) for p in params]
    plain = Sampler()(logits, rows)
    for guided_rows in ([0, 2], [1, 3]):
        out = Sampler()(logits, rows, TokenMask(guided_rows, bits))
        for row in range(4):
            if row in guided_rows:
                assert out.token_ids[row].item() in allowed
            else:
                assert out.token_ids[row].item() == plain.token_ids[row].item()
    # Greedy under the mask is the best allowed token; log-probabilities stay the model's own.
    out = Sampler()(logits, rows, TokenMask([0, 1], bits))
    assert out.token_ids[0].item() == max(allowed, key=lambda t: logits[0, t].item())
    assert out.logprobs[1].logprob == pytest.approx(torch.log_softmax(logits[1], -1)[out.token_ids[1]].item())


def test_packed_bits_unpack_to_llguidances_token_order() -> None:
    """Bit j of word w allows token 32 w + j, the sign bit included; past the words, nothing is allowed."""
    words = torch.tensor([[0b101, -(2**31)], [-1, 1 << 7]], dtype=torch.int32)
    allowed = allowed_tokens(words, 70)
    assert allowed.shape == (2, 70) and allowed.dtype == torch.bool
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 2, 63]
    assert torch.nonzero(allowed[1]).flatten().tolist() == list(range(32)) + [39]
    assert allowed_tokens(words, 40).shape == (2, 40)


def test_both_backends_allow_a_valid_output_and_refuse_an_invalid_one(tokenizer) -> None:
    """llguidance and xgrammar (which differ in the whitespace they allow between JSON tokens) both
    allow every token of an output that follows the schema, and neither a letter where the integer
    goes."""
    spec = GuidedDecoding(
        "json_schema",
        '{"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "bc"]}},'
        ' "required": ["n", "tag"], "additionalProperties": false}',
    )
    eos = tokenizer.eos_token_id
    for name in ("llguidance", "xgrammar"):
        matchers = GuidedMatchers(lambda: (tokenizer, {eos}), VOCAB, name)
        matchers.add("r", spec)
        prefix = tokenizer.encode('{"n": ')
        for token in prefix:
            assert token in allowed_ids(matchers, ["r"]) and matchers.consume("r", token) is None, name
        assert tokenizer.encode("x")[0] not in allowed_ids(matchers, ["r"]), name
        rest = tokenizer.encode('12, "tag": "bc"')
        for token in rest:
            assert token in allowed_ids(matchers, ["r"]) and matchers.consume("r", token) is None, name
        assert completing(matchers, "r", tokenizer.encode("}")[0], eos) == FinishReason.EOS_TOKEN, name


def test_an_unknown_or_missing_backend_is_refused_at_start_up(monkeypatch) -> None:
    import importlib.util

    from tgserve.router.serve_args import GUIDED_DECODING_BACKEND_NAMES
    from tgserve.server.sampling.grammar_backends import (
        GUIDED_DECODING_BACKENDS,
        check_guided_decoding_backend,
    )

    assert GUIDED_DECODING_BACKEND_NAMES == GUIDED_DECODING_BACKENDS
    with pytest.raises(ValueError, match="must be one of"):
        check_guided_decoding_backend("outlines")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"needs the xgrammar package.*tgserve\[xgrammar\]"):
        check_guided_decoding_backend("xgrammar")
