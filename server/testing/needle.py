"""Needle in a haystack with a real chat model: a fact planted at a chosen depth of a long filler
text, asked for at the end; the answer counts as found when the planted number is in the reply.

The haystack is English prose that ships with Python (the standard library's module docstrings,
in a fixed order), so it needs no download and is the same on every machine of one Python version.
Each placement has its own needle (a different key and number), so a model cannot carry one
answer over. Dense and selective decode attention are compared on the same engine and the same
prefilled KV cache: the prompt is prefilled once (its blocks then come from the prefix cache) and
each question is answered once with the backend's selection set and once without.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import random
from dataclasses import dataclass

from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams

MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "fractions", "functools", "getopt",
    "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http", "imaplib", "inspect",
    "ipaddress", "itertools", "json", "locale", "logging", "mailbox", "mimetypes", "operator",
    "optparse", "pathlib", "pickle", "pprint", "queue", "random", "shelve", "shlex", "shutil",
    "smtplib", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "typing", "unittest", "urllib", "uuid", "wave",
    "weakref", "zipfile",
)  # fmt: skip
KEYS = ("blue door", "old lighthouse", "silver key", "north tower", "paper boat", "green lantern",
        "quiet river", "iron bridge", "small garden", "red kite")  # fmt: skip


@dataclass(frozen=True)
class Placement:
    depth: float  # where the needle sits in the haystack, 0: its start, 1: its end
    key: str
    number: int

    @property
    def needle(self) -> str:
        return f" The secret number of the {self.key} is {self.number}. "

    @property
    def question(self) -> str:
        return f"What is the secret number of the {self.key}? Answer with the number only."


def placements(count: int, seed: int = 0) -> list[Placement]:
    """`count` needles at depths spread evenly over the haystack, each its own key and number."""
    rng = random.Random(seed)
    return [
        Placement(i / max(1, count - 1), KEYS[i % len(KEYS)], rng.randrange(10_000, 100_000))
        for i in range(count)
    ]


def haystack_sentences() -> list[str]:
    """Sentences of prose from the standard library's docstrings, in a fixed order."""
    sentences = []
    for name in MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        text = " ".join(line.strip() for line in doc.splitlines() if line.strip())
        sentences += [s.strip() + "." for s in text.split(". ") if len(s.split()) >= 4]
    return sentences


def needle_prompt(tokenizer, placement: Placement, haystack_tokens: int) -> list[int]:
    """The chat-templated prompt: about `haystack_tokens` of haystack with the needle at its depth,
    then the question."""
    sentences, pieces, used = haystack_sentences(), [], 0
    lengths = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in sentences]
    for sentence, length in itertools.cycle(zip(sentences, lengths)):  # again from the start if short
        if used + length > haystack_tokens:
            break
        pieces.append(sentence)
        used += length
    at = round(placement.depth * len(pieces))
    text = " ".join(pieces[:at]) + placement.needle + " ".join(pieces[at:])
    content = f"Read this text.\n\n{text}\n\n{placement.question}"
    return list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))  # fmt: skip


def answer(engine: LLMEngine, prompt: list[int], request_id: str, new_tokens: int = 24) -> str:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


@dataclass
class NeedleResult:
    placement: Placement
    prompt_tokens: int
    dense: str
    selective: str

    @property
    def dense_found(self) -> bool:
        return str(self.placement.number) in self.dense

    @property
    def selective_found(self) -> bool:
        return str(self.placement.number) in self.selective


def needle_run(engine: LLMEngine, placement: Placement, haystack_tokens: int) -> NeedleResult:
    """One placement answered densely, then selectively, on an engine built with a selection
    (`decode_attention_budget` and a threshold below the prompt's length), prefix caching, and on
    CUDA without graphs (its long-context graphs are captured selecting)."""
    backend = engine.shard.backend
    selection = backend.selection
    assert selection is not None, "the engine was built without selective decode attention"
    prompt = needle_prompt(engine.tokenizer, placement, haystack_tokens)
    try:
        backend.selection = None
        dense = answer(engine, prompt, f"dense-{placement.depth}")
    finally:
        backend.selection = selection
    return NeedleResult(placement, len(prompt), dense, answer(engine, prompt, f"selective-{placement.depth}"))
