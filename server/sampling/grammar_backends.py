"""The grammar libraries guided decoding can use (`--guided-decoding-backend`): llguidance, the
default, and xgrammar. Both compile a request's grammar against the tokenizer, fill token bitmasks
for a batch of matchers at once (each through its own thread pool) in the same layout (bit j of
int32 word w allows token 32 w + j), and advance a matcher by the tokens a request produces.

`guided.GuidedMatchers` holds the matchers; it sees them only through the backend's `fill` and
`consume` (a step's masks, a step's tokens, for all its matchers at once) and the five methods of
an llguidance `LLMatcher` (consume_token, consume_tokens, is_stopped, is_error, get_error), which
the xgrammar matcher below also offers. Either library is imported only when the first guided request
arrives.

The two differ where a grammar is complete: llguidance stops a matcher as soon as nothing but the
end of the sequence can follow (a JSON object's closing brace ends the request), xgrammar when the
end-of-sequence token is accepted (the mask then allows only that token, and the request ends one
token later with the same text). The router checks grammars with llguidance either way
(`protocol.grammar.check_grammar`); a grammar xgrammar then fails to compile ends its request with
finish reason "grammar_error".
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tgserve.server.protocol.grammar import ANY_OBJECT_SCHEMA, grammar_text
from tgserve.server.protocol.params import GuidedDecoding

GUIDED_DECODING_BACKENDS = ("llguidance", "xgrammar")


class LLGuidanceBackend:
    """llguidance: an `LLMatcher` a request, masks through its `LLExecutor`."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, vocab_size, list(eos_ids) or None)
        self.vocab_size = self.tokenizer.vocab_size
        self._executor = llguidance.LLExecutor()

    def matcher(self, spec: GuidedDecoding) -> Any:
        import llguidance

        return llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)

    def fill(self, pairs: list[tuple[Any, int]], bits: np.ndarray) -> None:
        """Row k of `bits` gets the next-token mask of the matcher paired with k."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bits)

    def consume(self, pairs: list[tuple[Any, int]]) -> list[bool]:
        """Each matcher takes its token (on the executor's threads); False where it refused it."""
        return self._executor.consume_token_par(pairs)


class XGrammarBackend:
    """xgrammar: grammars compiled by a `GrammarCompiler` (cached per schema), a `GrammarMatcher` a
    request, masks through a `BatchGrammarMatcher`."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids) or None
        )
        self.vocab_size = info.vocab_size
        self._compiler = xgrammar.GrammarCompiler(info)
        self._batch = xgrammar.BatchGrammarMatcher()
        self._batch_lock = threading.Lock()  # masks are filled on several threads (guided.MASK_WORKERS)

    def matcher(self, spec: GuidedDecoding) -> XGrammarMatcher:
        import xgrammar

        if spec.kind == "regex":
            compiled = self._compiler.compile_regex(spec.text)
        else:
            schema = spec.text if spec.kind == "json_schema" else ANY_OBJECT_SCHEMA
            compiled = self._compiler.compile_json_schema(schema)
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled))

    def fill(self, pairs: list[tuple[XGrammarMatcher, int]], bits: np.ndarray) -> None:
        import torch

        # xgrammar takes a torch int32 bitmask; this one shares the array's memory.
        if len(pairs) == 1:  # a request filled alone (its masks were late once): its own matcher
            matcher, k = pairs[0]
            matcher.inner.fill_next_token_bitmask(torch.from_numpy(bits), k)
            return
        with self._batch_lock:
            matchers = [matcher.inner for matcher, _ in pairs]
            self._batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bits), [k for _, k in pairs])

    @staticmethod
    def consume(pairs: list[tuple[XGrammarMatcher, int]]) -> list[bool]:
        """Each matcher takes its token; False where it refused it."""
        return [matcher.consume_token(token_id) for matcher, token_id in pairs]


class XGrammarMatcher:
    """An xgrammar `GrammarMatcher` behind the llguidance matcher methods `GuidedMatchers` calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._error = ""

    def consume_token(self, token_id: int) -> bool:
        if not self.inner.accept_token(token_id):
            self._error = f"token {token_id} is not allowed by the grammar here"
            return False
        return True

    def consume_tokens(self, token_ids: Sequence[int]) -> bool:
        return all(self.consume_token(token_id) for token_id in token_ids)

    def is_stopped(self) -> bool:
        return bool(self.inner.is_terminated())

    def is_error(self) -> bool:
        return bool(self._error)

    def get_error(self) -> str:
        return self._error


def check_guided_decoding_backend(name: str) -> None:
    """At start-up: `name` is a backend, and its library is installed (it is imported only later)."""
    import importlib.util

    if name not in GUIDED_DECODING_BACKENDS:
        raise ValueError(f"--guided-decoding-backend must be one of {GUIDED_DECODING_BACKENDS}, got {name!r}")
    if importlib.util.find_spec(name) is None:
        extra = " (pip install 'tgserve[xgrammar]')" if name == "xgrammar" else ""
        raise ValueError(
            f"--guided-decoding-backend {name} needs the {name} package, which is not installed{extra}"
        )


def grammar_backend(name: str, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """The backend `name` (one of GUIDED_DECODING_BACKENDS) for this tokenizer; the mask covers
    `vocab_size` tokens (the logits' width) or the tokenizer's, where that is larger."""
    backends = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}
    if name not in backends:
        raise ValueError(f"--guided-decoding-backend must be one of {GUIDED_DECODING_BACKENDS}, got {name!r}")
    return backends[name](hf_tokenizer, max(vocab_size, len(hf_tokenizer)), eos_ids)
