"""Incremental detokenization and stop strings, per generated sequence, in the router process.

Decoding one token at a time is wrong for most tokenizers: SentencePiece drops a word's leading space
when the token is decoded alone, and byte-level BPE splits one UTF-8 character over several tokens.
`IncrementalDetokenizer` uses the offset scheme of TGI and vLLM: decode a short window that ends at
the new token and a window that ends just before it, and release the difference once it no longer
ends in an incomplete character.

`StopChecker` finds stop strings in the released text, holding back any tail that could still become
a stop string so that a stream never shows text that a later token turns into a stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields
PROMPT_WINDOW = 5  # prompt tokens kept as left context, so the first output token decodes right

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas whose concatenation is the decoded text."""

    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int]):
        self._decode = decode
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_WINDOW:])
        self._prefix_offset = 0  # start of the context window in _ids
        self._read_offset = len(self._ids)  # end of what has been released

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        return self._release(allow_incomplete=False)

    def flush(self) -> str:
        """At the end of the sequence: release what is pending, even an incomplete character."""
        return self._release(allow_incomplete=True)

    def _release(self, allow_incomplete: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing to show yet
        if new_text.endswith(REPLACEMENT_CHAR) and not allow_incomplete:
            return ""
        delta = new_text[len(prefix_text) :]
        # Keep only the window that the next call needs, so the work per token stays constant.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta


class StopChecker:
    """Finds the first stop string in a growing text and says which part of the text may be shown.

    include_stop: TGI keeps the stop string in the output; OpenAI (and vLLM by default) drop it.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the output text so far, cut at the stop string once one is found
        self.released = 0  # characters of `text` already shown
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add new text; return the part that can be shown now. Sets `stopped` when a stop string appears."""
        if self.stopped or not delta:
            return ""
        # A stop string may straddle the old text and the delta; it cannot start any earlier.
        search_from = max(0, len(self.text) - self.max_len + 1)
        self.text += delta
        if not self.stops:
            return self._release_to(len(self.text))
        found = self._find_stop(search_from)
        if found is not None:
            start, stop = found
            self.text = self.text[: start + len(stop)] if self.include_stop else self.text[:start]
            self.stopped = True
            return self._release_to(len(self.text))
        return self._release_to(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The sequence ended for another reason: what was held back is output after all."""
        return self._release_to(len(self.text))

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """The earliest stop string occurrence at or after search_from (the longest one on a tie)."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = self.text.find(stop, search_from)
            if index < 0:
                continue
            if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
                best = (index, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest unreleased tail that is a proper prefix of some stop string."""
        longest = min(self.max_len - 1, len(self.text) - self.released)
        for length in range(longest, 0, -1):
            tail = self.text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0

    def _release_to(self, end: int) -> str:
        if end <= self.released:
            return ""
        chunk = self.text[self.released : end]
        self.released = end
        return chunk
