"""Random prompts of an exact token length, built once and shared by the server and offline runs."""

from __future__ import annotations

import random
from collections.abc import Callable

# Common words: random sequences of them tokenize to ordinary text in any vocabulary, and two
# prompts share no prefix longer than a word or two, so prefix caching does not flatter the numbers.
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact be have do say get make go know take see come think look "
    "want give use find tell ask seem feel try leave call good new first last long great little own other old "
    "right big high different small large next early young important few public bad same able to of in for "
    "on with at by from up about into over after river mountain city music light water story garden window "
    "paper engine market table letter winter summer morning evening history science language animal forest "
    "ocean bridge station kitchen doctor teacher student friend family village island energy money answer"
).split()


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def build_prompts(
    tokenize: Callable[[str], list[int]], num_prompts: int, input_len: int, seed: int
) -> list[list[int]]:
    """`num_prompts` token-id prompts of exactly `input_len` tokens each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        ids: list[int] = []
        while len(ids) < input_len:
            ids += tokenize(random_text(rng, input_len))
        prompts.append(ids[:input_len])
    return prompts


def arrival_delays(rng: random.Random, count: int, rate: float) -> list[float]:
    """Gaps between request arrivals: all at once for an infinite rate, else a Poisson process."""
    if rate == float("inf"):
        return [0.0] * count
    return [rng.expovariate(rate) for _ in range(count)]
