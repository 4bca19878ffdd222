"""API-neutral request validation: the admission limits, then `SamplingParams`' own checks.

Both APIs translate their parameters into `Knobs`, and `build_spec` turns a tokenized prompt and
knobs into a `GenerationSpec`, or raises a `ValidationError` whose message names the limit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tgserve.router.config import RouterConfig
from tgserve.router.errors import ValidationError
from tgserve.router.tokenization import RouterTokenizer
from tgserve.server.sampling_params import InvalidRequestError, SamplingParams

# Seeds are 64-bit: TGI takes unsigned ones, vLLM signed ones; both ranges are accepted and a
# negative seed stands for its unsigned twin (the sampler derives its generators' seeds from 64 bits).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class Knobs:
    """Sampling and stopping parameters common to both APIs, after each API's own defaults."""

    max_new_tokens: int | None = None  # None: whatever --max-total-tokens leaves
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the chosen token's and the n best alternatives'
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (TGI prefill, OpenAI echo)
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1  # engine requests for this prompt (OpenAI's n, TGI's best_of)


@dataclass(frozen=True)
class GenerationSpec:
    """One prompt and the engine requests made from it (one per sampled sequence)."""

    prompt_token_ids: list[int]
    params: list[SamplingParams]
    stop: tuple[str, ...]
    include_stop: bool  # TGI keeps the stop string in the output, OpenAI drops it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def check_limits(config: RouterConfig, num_prompt_tokens: int, knobs: Knobs) -> int:
    """Check the token and count limits; returns the number of new tokens to allow."""
    if num_prompt_tokens == 0:
        raise ValidationError("the prompt is empty: at least one token is needed", param="prompt")
    if num_prompt_tokens > config.input_limit:
        raise ValidationError(
            f"the prompt has {num_prompt_tokens} tokens, more than --max-input-tokens={config.input_limit}",
            param="prompt",
        )
    room = config.total_limit - num_prompt_tokens
    max_new_tokens = room if knobs.max_new_tokens is None else knobs.max_new_tokens
    if max_new_tokens <= 0:
        raise ValidationError(f"max_new_tokens must be positive, got {max_new_tokens}", param="max_tokens")
    if max_new_tokens > room:
        raise ValidationError(
            f"the prompt's {num_prompt_tokens} tokens plus max_new_tokens={max_new_tokens} exceed "
            f"--max-total-tokens={config.total_limit}",
            param="max_tokens",
        )
    if len(knobs.stop) > config.max_stop_sequences:
        raise ValidationError(
            f"{len(knobs.stop)} stop sequences given, more than --max-stop-sequences={config.max_stop_sequences}",
            param="stop",
        )
    if any(not s for s in knobs.stop):
        raise ValidationError("stop sequences must not be empty strings", param="stop")
    if knobs.logprobs is not None and not 0 <= knobs.logprobs <= config.max_top_n_tokens:
        raise ValidationError(
            f"{knobs.logprobs} top log-probabilities asked for; the range is 0 to "
            f"--max-top-n-tokens={config.max_top_n_tokens}",
            param="logprobs",
        )
    return max_new_tokens


def sequence_seeds(knobs: Knobs) -> list[int | None]:
    """One seed per sequence: derived from the given seed (reproducible), else drawn at random.

    Greedy sequences need none. Sampled ones always get one, so that responses can report it.
    """
    if knobs.temperature == 0.0:
        return [None] * knobs.n
    if knobs.seed is None:
        return [random.randint(0, MAX_SEED) for _ in range(knobs.n)]
    if not MIN_SEED <= knobs.seed <= MAX_SEED:
        raise ValidationError(
            f"seed must be a 64-bit integer, in [{MIN_SEED}, {MAX_SEED}]; got {knobs.seed}", param="seed"
        )
    return [(knobs.seed + i) % (MAX_SEED + 1) for i in range(knobs.n)]


def make_params(
    knobs: Knobs, max_new_tokens: int, seed: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """SamplingParams checks its own ranges; its message becomes the client's."""
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=knobs.temperature,
            top_k=knobs.top_k,
            top_p=knobs.top_p,
            typical_p=knobs.typical_p,
            min_p=knobs.min_p,
            repetition_penalty=knobs.repetition_penalty,
            frequency_penalty=knobs.frequency_penalty,
            presence_penalty=knobs.presence_penalty,
            seed=seed,
            stop_token_ids=knobs.stop_token_ids,
            stop=knobs.stop,
            ignore_eos=knobs.ignore_eos,
            logprobs=knobs.logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=dict(knobs.logit_bias),
        )
    except InvalidRequestError as exc:
        raise ValidationError(str(exc)) from exc


def build_spec(
    config: RouterConfig,
    tokenizer: RouterTokenizer,
    prompt_token_ids: list[int],
    knobs: Knobs,
    include_stop: bool,
) -> GenerationSpec:
    """Validate everything about one prompt's generation, then describe its engine requests."""
    max_new_tokens = check_limits(config, len(prompt_token_ids), knobs)
    tokenizer.check_ids(prompt_token_ids, "prompt")
    tokenizer.check_ids(list(knobs.logit_bias), "logit_bias")
    tokenizer.check_ids(list(knobs.stop_token_ids), "stop_token_ids")
    # The prompt is scored once, by the first of its sequences: the others share its answer.
    params = [
        make_params(knobs, max_new_tokens, seed, knobs.prompt_logprobs if i == 0 else None)
        for i, seed in enumerate(sequence_seeds(knobs))
    ]
    return GenerationSpec(list(prompt_token_ids), params, tuple(knobs.stop), include_stop)
