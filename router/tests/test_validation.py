"""Admission limits, parameter translation and chat templates, without an engine."""

from __future__ import annotations

import pytest

from tgserve.router.config import RouterConfig
from tgserve.router.errors import ValidationError
from tgserve.router.openai_schemas import CompletionRequest, logit_bias, openai_sampling
from tgserve.router.tgi_schemas import TGIParameters, tgi_sampling
from tgserve.router.tokenization import RouterTokenizer
from tgserve.router.validation import (
    SamplingRequest,
    build_spec,
    check_fields,
    check_limits,
    sampling_params,
    sequence_seeds,
)
from tgserve.server.protocol.params import SamplingParams

CONFIG = RouterConfig(max_input_tokens=10, max_total_tokens=20).resolve(64)


def ask(max_new_tokens: int | None = None, n: int = 1, **params) -> SamplingRequest:
    return SamplingRequest(SamplingParams(**params), max_new_tokens, n)


def test_resolve_derives_token_limits_from_the_model():
    config = RouterConfig().resolve(100)
    assert (config.input_limit, config.total_limit) == (99, 100)
    with pytest.raises(ValueError, match="max-total-tokens"):
        RouterConfig(max_total_tokens=200).resolve(100)
    with pytest.raises(ValueError, match="max-input-tokens"):
        RouterConfig(max_input_tokens=100).resolve(100)


@pytest.mark.parametrize(
    ("prompt_len", "asked", "message"),
    [
        (0, ask(), "prompt is empty"),
        (11, ask(), "--max-input-tokens=10"),
        (10, ask(max_new_tokens=11), "--max-total-tokens=20"),
        (5, ask(stop=("a",) * 5), "--max-stop-sequences=4"),
        (5, ask(stop=("",)), "must not be empty"),
        (5, ask(logprobs=6), "--max-top-n-tokens=5"),
    ],
)
def test_limits_name_the_flag(prompt_len, asked, message):
    with pytest.raises(ValidationError, match=message):
        check_limits(CONFIG, prompt_len, asked)


def test_max_new_tokens_defaults_to_what_the_total_leaves():
    assert check_limits(CONFIG, 8, ask()) == 12
    assert check_limits(CONFIG, 8, ask(max_new_tokens=3)) == 3


def test_seeds_are_derived_and_reproducible():
    assert sequence_seeds(ask(seed=7, n=3)) == [7, 8, 9]
    assert sequence_seeds(ask(temperature=0.0, n=2)) == [None, None]
    drawn = sequence_seeds(ask(n=3))
    assert len(set(drawn)) == 3 and all(isinstance(s, int) for s in drawn)
    assert sequence_seeds(ask(seed=-1, n=2)) == [2**64 - 1, 0]  # a signed seed's unsigned twin
    for seed, temperature in ((2**64, 1.0), (-(2**63) - 1, 1.0), (2**64, 0.0)):  # greedy or not
        with pytest.raises(ValidationError, match="64-bit"):
            check_fields(CONFIG, ask(seed=seed, temperature=temperature))


def test_build_spec_checks_sampling_params_and_vocabulary(tokenizer):
    with pytest.raises(ValidationError, match="top_p"):
        sampling_params(top_p=0.0)
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        build_spec(CONFIG, tokenizer, [1, 10**6], ask(), include_stop=False)
    with pytest.raises(ValidationError, match="logit_bias"):
        build_spec(CONFIG, tokenizer, [1], ask(logit_bias={10**6: 1.0}), include_stop=False)
    spec = build_spec(CONFIG, tokenizer, [1, 2], ask(n=2, seed=1, max_new_tokens=4), include_stop=True)
    assert [p.seed for p in spec.params] == [1, 2]
    assert all(p.max_new_tokens == 4 for p in spec.params)


def test_tgi_greedy_unless_sampling_is_asked_for():
    assert tgi_sampling(TGIParameters(), CONFIG, stream=False).params.temperature == 0.0
    assert tgi_sampling(TGIParameters(temperature=0.7), CONFIG, stream=False).params.temperature == 0.7
    assert tgi_sampling(TGIParameters(do_sample=True), CONFIG, stream=False).params.temperature == 1.0
    assert tgi_sampling(TGIParameters(top_k=5), CONFIG, stream=False).params.top_k == 5


def test_tgi_streams_and_details_carry_logprobs():
    assert tgi_sampling(TGIParameters(), CONFIG, stream=False).params.logprobs is None
    assert tgi_sampling(TGIParameters(), CONFIG, stream=True).params.logprobs == 0
    assert (
        tgi_sampling(TGIParameters(details=True, top_n_tokens=3), CONFIG, stream=False).params.logprobs == 3
    )


@pytest.mark.parametrize(
    ("params", "stream", "message"),
    [
        (TGIParameters(temperature=0.0), False, "strictly positive"),
        (TGIParameters(best_of=3, do_sample=True), False, "--max-best-of=2"),
        (TGIParameters(best_of=2), False, "sampling"),
        (TGIParameters(best_of=2, do_sample=True), True, "streaming"),
        (TGIParameters(truncate=11), False, "--max-input-tokens=10"),
        (
            TGIParameters(grammar={"type": "regex", "value": "(("}),
            False,
            "regular expression.*unclosed group",
        ),
        (TGIParameters(grammar={"type": "json", "value": {"type": "nope"}}), False, "JSON schema.*nope"),
        (TGIParameters(watermark=True), False, "`watermark`.*not supported"),
        (TGIParameters(decoder_input_details=True), True, "not supported when streaming"),
    ],
)
def test_tgi_rules(params, stream, message):
    with pytest.raises(ValidationError, match=message):
        tgi_sampling(params, CONFIG, stream)


def test_openai_translation():
    request = CompletionRequest(prompt="x", temperature=0.0, top_k=-1, stop="END", logit_bias={"5": -100})
    sampling = openai_sampling(request, CONFIG, 5, None, 1)
    params = sampling.params
    assert (params.temperature, params.top_k, params.stop, params.logit_bias) == (
        0.0,
        0,
        ("END",),
        {5: -100.0},
    )
    assert (sampling.max_new_tokens, sampling.n) == (5, 1)
    with pytest.raises(ValidationError, match="limit"):
        openai_sampling(request, CONFIG, 5, None, 100)


def test_logit_bias_bounds():
    with pytest.raises(ValidationError, match="not a token id"):
        logit_bias({"abc": 1.0})
    with pytest.raises(ValidationError, match=r"\[-100, 100\]"):
        logit_bias({"1": 101.0})


def test_warming_up_a_chat_template_that_refuses_a_lone_user_message(tokenizer) -> None:
    """The start-up render is only a warm-up: a template's refusal of its probe is not an error."""
    strict = RouterTokenizer(
        tokenizer.tokenizer,
        chat_template=(
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
            "{{ messages[-1]['content'] }}"
        ),
    )
    strict.warm_up_chat_template()
    with pytest.raises(ValidationError, match="a system message first"):
        strict.chat_prompt([{"role": "user", "content": "hi"}])
    assert strict.chat_prompt([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]) == "hi"
    RouterTokenizer(tokenizer.tokenizer).warm_up_chat_template()  # no template: nothing to render


# Processor templates of multimodal models read content as a list of parts (Llava's only so).
LIST_ONLY_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}; {% endfor %}"
)
EITHER_TEMPLATE = (
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for part in m.content %}{{ part.text }}{% endfor %}{% endif %}|{% endfor %}"
)


@pytest.mark.parametrize(
    "template,expected",
    [(LIST_ONLY_TEMPLATE, "system: Be brief.; user: Hi there; "), (EITHER_TEMPLATE, "Be brief.|Hi there|")],
    ids=["list-only", "either"],
)
def test_templates_that_loop_over_content_get_text_parts(tokenizer, template, expected) -> None:
    chat = RouterTokenizer(tokenizer.tokenizer, chat_template=template)
    assert chat.content_as_parts
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert chat.chat_prompt(messages) == expected


def test_templates_that_print_content_get_strings(tokenizer) -> None:
    chat = RouterTokenizer(
        tokenizer.tokenizer, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    assert not chat.content_as_parts
    assert chat.chat_prompt([{"role": "user", "content": "Hi"}]) == "[Hi]"


def test_the_token_limits_default_to_what_the_kv_pool_holds_when_that_is_less() -> None:
    assert RouterConfig().resolve(8192, 4096).total_limit == 4096  # the pool holds 4,096 tokens
    assert RouterConfig().resolve(8192, 4096).input_limit == 4095
    assert RouterConfig().resolve(8192, 100_000).total_limit == 8192  # the model's length
    assert RouterConfig().resolve(8192).total_limit == 8192  # an engine that does not say
    assert RouterConfig(max_total_tokens=6000).resolve(8192, 4096).total_limit == 6000  # as asked
