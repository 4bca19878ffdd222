"""SequenceState turns engine deltas into text (stop strings, special tokens); admission counts."""

from __future__ import annotations

import pytest

from tgserve.router.config import RouterConfig
from tgserve.router.errors import OverloadedError
from tgserve.router.generation import Admission, SequenceState
from tgserve.router.validation import SamplingRequest, build_spec
from tgserve.server.protocol.outputs import RequestOutput, TokenLogprob
from tgserve.server.protocol.params import SamplingParams

CONFIG = RouterConfig().resolve(256)


def run(tokenizer, text: str, stop=(), include_stop=False, finish="length", logprobs=None):
    prompt = tokenizer.encode("Hello")
    spec = build_spec(
        CONFIG,
        tokenizer,
        prompt,
        SamplingRequest(SamplingParams(stop=tuple(stop), logprobs=logprobs)),
        include_stop,
    )
    state = SequenceState(0, 0, tokenizer, spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = []
    for position, token in enumerate(ids):
        last = position == len(ids) - 1
        lps = [TokenLogprob(token, -1.0, [(token, -1.0)])] if logprobs is not None else None
        output = RequestOutput(
            "r", [token], lps, last, finish if last else None, len(prompt), 0, position + 1
        )
        deltas.append(state.apply(output))
        if state.finished:
            break
    return state, deltas


def test_text_is_the_concatenation_of_deltas(tokenizer):
    state, deltas = run(tokenizer, " the quick brown fox")
    assert state.text == "".join(d.text for d in deltas) == " the quick brown fox"
    assert state.finish_reason == "length"
    assert deltas[-1].num_generated_tokens == len(state.tokens)


def test_stop_string_ends_the_sequence_and_is_dropped(tokenizer):
    state, deltas = run(tokenizer, " one two. three four", stop=["."])
    assert state.text == " one two"
    assert state.finish_reason == "stop_sequence"
    assert deltas[-1].finish_reason == "stop_sequence"


def test_stop_string_kept_for_tgi(tokenizer):
    state, _ = run(tokenizer, " one two. three", stop=["."], include_stop=True)
    assert state.text == " one two."


def test_eos_is_special_and_not_in_the_text(tokenizer):
    state, _ = run(tokenizer, " done<|im_end|>", finish="eos_token")
    assert state.text == " done"
    assert state.tokens[-1].special and state.tokens[-1].text == "<|im_end|>"
    assert state.finish_reason == "eos_token"


def test_logprobs_travel_with_tokens(tokenizer):
    state, _ = run(tokenizer, " hi there", logprobs=1)
    assert all(t.logprob == -1.0 and t.top == [(t.id, -1.0)] for t in state.tokens)


def test_admission_refuses_over_the_limit():
    admission = Admission(2)
    admission.acquire()
    admission.acquire()
    with pytest.raises(OverloadedError, match="--max-concurrent-requests=2"):
        admission.acquire()
    admission.release()
    admission.acquire()
