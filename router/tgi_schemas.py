"""TGI's request shape and its translation into the router's `SamplingRequest`, with TGI's own rules."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tgserve.router.config import RouterConfig
from tgserve.router.errors import ValidationError
from tgserve.router.guided import TGIGrammar, grammar_guided
from tgserve.router.schema_rules import (
    MAX_BEST_OF,
    MAX_INPUT_TOKENS,
    MAX_NEW_TOKENS,
    MAX_TOP_N_TOKENS,
    flag_bound,
    non_empty_stop,
    number_bounds,
    tgi_best_of_samples,
    tgi_streams_take_stream_parameters,
    whole,
)
from tgserve.router.validation import MAX_SEED, MAX_TOP_K, SamplingRequest, sampling_params

STRICT = ConfigDict(extra="ignore", strict=True)


class TGIParameters(BaseModel):
    """`parameters` of /generate, /generate_stream and / (null means "not given", as clients send it)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=tgi_best_of_samples)

    # The schema states the ranges that `check_tgi_rules` and SamplingParams check with messages of
    # their own, and the features refused (no LoRA adapters, no watermark), apart from the flags'.
    adapter_id: str | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "null"}]})
    best_of: whole(gt=0) | None = Field(default=None, json_schema_extra=flag_bound(MAX_BEST_OF))
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = Field(
        default=None, json_schema_extra=number_bounds(minimum=-2, maximum=2)
    )
    grammar: TGIGrammar | None = None
    max_new_tokens: whole(gt=0) | None = Field(default=None, json_schema_extra=flag_bound(MAX_NEW_TOKENS))
    repetition_penalty: float | None = Field(
        default=None, json_schema_extra=number_bounds(exclusiveMinimum=0)
    )
    return_full_text: bool | None = None
    seed: whole(ge=0) | None = Field(default=None, json_schema_extra=number_bounds(maximum=MAX_SEED))
    stop: list[str] | None = Field(default=None, json_schema_extra=non_empty_stop)
    temperature: float | None = Field(default=None, json_schema_extra=number_bounds(exclusiveMinimum=0))
    top_k: whole() | None = Field(default=None, json_schema_extra=number_bounds(minimum=1, maximum=MAX_TOP_K))
    top_n_tokens: whole(ge=0) | None = Field(default=None, json_schema_extra=flag_bound(MAX_TOP_N_TOKENS))
    top_p: float | None = Field(default=None, json_schema_extra=number_bounds(exclusiveMinimum=0, maximum=1))
    truncate: whole(gt=0) | None = Field(default=None, json_schema_extra=flag_bound(MAX_INPUT_TOKENS))
    typical_p: float | None = Field(
        default=None, json_schema_extra=number_bounds(exclusiveMinimum=0, maximum=1)
    )
    watermark: bool = Field(default=False, json_schema_extra={"enum": [False]})


class TGIRequest(BaseModel):
    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra=tgi_streams_take_stream_parameters
    )

    # An empty prompt is refused once tokenized (nothing to continue); the schema says so too.
    inputs: str = Field(json_schema_extra={"minLength": 1})
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


class TGITokenizeRequest(BaseModel):
    model_config = STRICT

    inputs: str
    # Taken and not read (TGI's /tokenize takes a whole generate request): nothing is generated.
    parameters: dict[str, Any] = Field(default_factory=dict)


def is_sampling(params: TGIParameters) -> bool:
    """TGI samples when asked to, or when any warper is set away from its neutral value."""
    return (
        params.do_sample
        or (params.temperature is not None and params.temperature != 1.0)
        or bool(params.top_k)
        or (params.top_p is not None and params.top_p < 1.0)
        or (params.typical_p is not None and params.typical_p < 1.0)
    )


def wants_details(params: TGIParameters) -> bool:
    """TGI answers with details when asked for them or for the prompt's (decoder_input_details)."""
    return params.details or params.decoder_input_details


def check_tgi_rules(params: TGIParameters, config: RouterConfig, stream: bool) -> int:
    """TGI's checks beyond SamplingParams' ranges; returns best_of (1 when not given)."""
    if params.adapter_id is not None:
        raise ValidationError(
            "`adapter_id` (LoRA adapters) is not supported by this server", param="adapter_id"
        )
    if params.watermark:
        raise ValidationError(
            "`watermark` (TGI's green-list watermark) is not supported by this server: the text would come "
            "back unmarked",
            param="watermark",
        )
    if stream and params.decoder_input_details:
        raise ValidationError(
            "`decoder_input_details` == true is not supported when streaming tokens",
            param="decoder_input_details",
        )
    if params.temperature is not None and params.temperature <= 0.0:
        raise ValidationError("`temperature` must be strictly positive", param="temperature")
    if params.top_k is not None and params.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive", param="top_k")
    if params.truncate is not None and params.truncate > config.input_limit:
        raise ValidationError(
            f"`truncate` must be <= --max-input-tokens={config.input_limit}, got {params.truncate}",
            param="truncate",
        )
    best_of = params.best_of or 1
    if best_of > 1:
        if best_of > config.max_best_of:
            raise ValidationError(
                f"`best_of` is {best_of}, more than --max-best-of={config.max_best_of}", param="best_of"
            )
        if not is_sampling(params):
            raise ValidationError(
                "you must use sampling (`do_sample`) when `best_of` is > 1", param="best_of"
            )
        if stream:
            raise ValidationError("`best_of` != 1 is not allowed for streaming", param="best_of")
    return best_of


def tgi_sampling(params: TGIParameters, config: RouterConfig, stream: bool) -> SamplingRequest:
    """Translate TGI parameters; streams and details always carry log-probabilities, like TGI."""
    best_of = check_tgi_rules(params, config, stream)
    sampling = is_sampling(params)
    wants_logprobs = stream or wants_details(params) or best_of > 1
    logprobs = params.top_n_tokens if params.top_n_tokens else (0 if wants_logprobs else None)
    sampled = sampling_params(
        temperature=(params.temperature or 1.0) if sampling else 0.0,
        top_k=(params.top_k or 0) if sampling else 0,
        # Passed as given, sampling or not: SamplingParams checks their ranges (a value below 1
        # makes the request sample, so a greedy one carries only 1 or an out-of-range value).
        top_p=1.0 if params.top_p is None else params.top_p,
        typical_p=1.0 if params.typical_p is None else params.typical_p,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty is not None else 1.0,
        frequency_penalty=params.frequency_penalty or 0.0,
        seed=params.seed,
        stop=tuple(params.stop or ()),
        logprobs=logprobs,
        prompt_logprobs=0 if params.decoder_input_details else None,
        guided=grammar_guided(params.grammar),
    )
    return SamplingRequest(sampled, params.max_new_tokens, best_of)
