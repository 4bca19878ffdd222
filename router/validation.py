"""API-neutral request validation: `SamplingParams`' own checks, then the admission limits.

Both APIs translate their parameters into a `SamplingRequest`: the engine's `SamplingParams`, built
through `sampling_params` so that its range checks answer the client, and what the router decides
per sequence. `build_spec` turns a tokenized prompt and that request into a `GenerationSpec`, or
raises a `ValidationError` whose message names the limit.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from tgserve.router.config import RouterConfig
from tgserve.router.errors import ValidationError
from tgserve.router.tokenization import RouterTokenizer
from tgserve.server.protocol.params import InvalidRequestError, SamplingParams

# Seeds are 64-bit: TGI takes unsigned ones, vLLM signed ones; both ranges are accepted and a
# negative seed stands for its unsigned twin (the sampler derives its generators' seeds from 64 bits).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# TGI's top_k is an unsigned 32-bit integer; a larger one cannot reach the engine (its messages carry
# 64-bit integers) and means nothing more than "every token".
MAX_TOP_K = 2**32 - 1


def sampling_params(**fields: Any) -> SamplingParams:
    """`SamplingParams(**fields)`; its range checks' message becomes the client's."""
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as exc:
        raise ValidationError(str(exc)) from exc


@dataclass(frozen=True)
class SamplingRequest:
    """One prompt's generation as an API asked for it: the engine's parameters for each of its `n`
    sequences, but for what `build_spec` sets per sequence: `params.max_new_tokens` (from
    `max_new_tokens`, or what --max-total-tokens leaves when that is None), the seed (derived from
    `params.seed`) and prompt scoring (`params.prompt_logprobs`, by the first sequence only)."""

    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int | None = None
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


def check_limits(config: RouterConfig, num_prompt_tokens: int, request: SamplingRequest) -> int:
    """Check the token and count limits; returns the number of new tokens to allow."""
    if num_prompt_tokens == 0:
        raise ValidationError("the prompt is empty: at least one token is needed", param="prompt")
    if num_prompt_tokens > config.input_limit:
        raise ValidationError(
            f"the prompt has {num_prompt_tokens} tokens, more than --max-input-tokens={config.input_limit}",
            param="prompt",
        )
    room = config.total_limit - num_prompt_tokens
    max_new_tokens = room if request.max_new_tokens is None else request.max_new_tokens
    if max_new_tokens <= 0:
        raise ValidationError(f"max_new_tokens must be positive, got {max_new_tokens}", param="max_tokens")
    if max_new_tokens > room:
        raise ValidationError(
            f"the prompt's {num_prompt_tokens} tokens plus max_new_tokens={max_new_tokens} exceed "
            f"--max-total-tokens={config.total_limit}",
            param="max_tokens",
        )
    check_fields(config, request)
    return max_new_tokens


def check_fields(config: RouterConfig, request: SamplingRequest) -> None:
    """Check the limits that do not depend on the prompt (what /openapi.json can state)."""
    params = request.params
    if params.seed is not None and not MIN_SEED <= params.seed <= MAX_SEED:  # greedy or not: as stated
        raise ValidationError(
            f"seed must be a 64-bit integer, in [{MIN_SEED}, {MAX_SEED}]; got {params.seed}", param="seed"
        )
    if params.top_k > MAX_TOP_K:
        raise ValidationError(f"top_k must be at most {MAX_TOP_K}, got {params.top_k}", param="top_k")
    most = config.total_limit - 1  # after a prompt of one token
    if request.max_new_tokens is not None and request.max_new_tokens > most:
        raise ValidationError(
            f"max_new_tokens={request.max_new_tokens} leaves no room for a prompt within "
            f"--max-total-tokens={config.total_limit}",
            param="max_tokens",
        )
    if len(params.stop) > config.max_stop_sequences:
        raise ValidationError(
            f"{len(params.stop)} stop sequences given, more than --max-stop-sequences={config.max_stop_sequences}",
            param="stop",
        )
    if any(not s for s in params.stop):
        raise ValidationError("stop sequences must not be empty strings", param="stop")
    if params.logprobs is not None and not 0 <= params.logprobs <= config.max_top_n_tokens:
        raise ValidationError(
            f"{params.logprobs} top log-probabilities asked for; the range is 0 to "
            f"--max-top-n-tokens={config.max_top_n_tokens}",
            param="logprobs",
        )


def sequence_seeds(request: SamplingRequest) -> list[int | None]:
    """One seed per sequence: derived from the given seed (reproducible), else drawn at random.

    Greedy sequences need none. Sampled ones always get one, so that responses can report it.
    """
    seed, n = request.params.seed, request.n
    if request.params.greedy:
        return [None] * n
    if seed is None:
        return [random.randint(0, MAX_SEED) for _ in range(n)]
    return [(seed + i) % (MAX_SEED + 1) for i in range(n)]


def check_token_ids(tokenizer: RouterTokenizer, params: SamplingParams) -> None:
    """The token ids that sampling fields name (logit_bias, stop_token_ids) are in the vocabulary."""
    tokenizer.check_ids(list(params.logit_bias), "logit_bias")
    tokenizer.check_ids(list(params.stop_token_ids), "stop_token_ids")


def build_spec(
    config: RouterConfig,
    tokenizer: RouterTokenizer,
    prompt_token_ids: list[int],
    request: SamplingRequest,
    include_stop: bool,
) -> GenerationSpec:
    """Validate everything about one prompt's generation, then describe its engine requests."""
    max_new_tokens = check_limits(config, len(prompt_token_ids), request)
    shared = request.params
    tokenizer.check_ids(prompt_token_ids, "prompt")
    check_token_ids(tokenizer, shared)
    # The prompt is scored once, by the first of its sequences: the others share its answer.
    params = [
        dataclasses.replace(
            shared,
            max_new_tokens=max_new_tokens,
            seed=seed,
            prompt_logprobs=shared.prompt_logprobs if i == 0 else None,
            logit_bias=dict(shared.logit_bias),
        )
        for i, seed in enumerate(sequence_seeds(request))
    ]
    return GenerationSpec(list(prompt_token_ids), params, shared.stop, include_stop)
