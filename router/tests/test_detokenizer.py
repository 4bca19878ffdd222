"""Incremental detokenization and stop strings, without an engine."""

from __future__ import annotations

import pytest

from tgserve.router.detokenizer import IncrementalDetokenizer, StopChecker


def stream(tokenizer, text: str, prompt: str = "Hello") -> list[str]:
    detok = IncrementalDetokenizer(tokenizer.decode, tokenizer.encode(prompt))
    deltas = [detok.add(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize(
    "text",
    [
        " the quick brown fox",
        "Water boils at 100 degrees.",
        " naïve café 日本語 🙂 done",
        "\n\n  def add(a, b):\n",
    ],
)
def test_deltas_concatenate_to_the_decoded_text(tokenizer, text):
    assert "".join(stream(tokenizer, text)) == text


def test_multibyte_characters_are_never_split(tokenizer):
    deltas = stream(tokenizer, " 🙂🙂 日本")
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == " 🙂🙂 日本"


def test_flush_releases_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "byte-level BPE splits an emoji the tiny corpus lacks"
    detok = IncrementalDetokenizer(tokenizer.decode, tokenizer.encode("x"))
    assert detok.add(ids[0]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.decode, tokenizer.encode("Hi"))
    text = "".join(detok.add(t) for t in tokenizer.encode(" there", add_special_tokens=False) + eos)
    assert text == " there"


def feed_all(checker: StopChecker, pieces: list[str]) -> str:
    shown = ""
    for piece in pieces:
        shown += checker.feed(piece)
        if checker.stopped:
            return shown
    return shown + checker.flush()


def test_stop_string_inside_one_delta():
    checker = StopChecker(["STOP"])
    assert feed_all(checker, ["abc STOP def"]) == "abc "
    assert checker.stopped


def test_stop_string_straddling_deltas_is_never_shown():
    checker = StopChecker(["</end>"])
    shown = [checker.feed(p) for p in ["Hello </", "en", "d> more"]]
    assert shown == ["Hello ", "", ""]
    assert checker.stopped and checker.text == "Hello "


def test_held_back_prefix_is_released_when_it_diverges():
    checker = StopChecker(["abc"])
    assert checker.feed("xa") == "x"
    assert checker.feed("b") == ""
    assert checker.feed("d") == "abd"
    assert not checker.stopped


def test_flush_releases_what_was_held_back():
    checker = StopChecker(["abc"])
    assert checker.feed("hello ab") == "hello "
    assert checker.flush() == "ab"


def test_include_stop_keeps_the_stop_string():
    checker = StopChecker(["\n\n"], include_stop=True)
    assert feed_all(checker, ["one\n", "\ntwo"]) == "one\n\n"


def test_earliest_stop_wins():
    checker = StopChecker(["world", "lo"])
    assert feed_all(checker, ["hello world"]) == "hel"


def test_no_stops_passes_everything_through():
    checker = StopChecker([])
    assert [checker.feed(p) for p in ["a", "b"]] == ["a", "b"]
    assert checker.flush() == ""
