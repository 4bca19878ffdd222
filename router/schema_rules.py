"""What the request bodies' schemas in /openapi.json state beyond pydantic's types: the rules the
server enforces that a schema can say (a prompt is never empty, a token id is in the vocabulary),
so that clients and fuzzers built from the schema send what the server takes.

Bounds that the served model or the server's flags set (token ids below the vocabulary's size,
TGI's best_of and truncate) are marked where a field is declared and filled in when /openapi.json
is built (`fill_bounds`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

# Marks of bounds that the served model and the server's flags set, replaced by a "maximum" when
# /openapi.json is built (`fill_bounds`).
TOKEN_ID = "x-tgserve-token-id"  # a token id: below the vocabulary's size
MAX_BEST_OF = "x-tgserve-max-best-of"  # TGI's best_of: at most --max-best-of
MAX_INPUT_TOKENS = "x-tgserve-max-input-tokens"  # TGI's truncate: at most --max-input-tokens
# TGI's top_n_tokens, OpenAI's logprobs (completions) and top_logprobs (chat): at most --max-top-n-tokens
MAX_TOP_N_TOKENS = "x-tgserve-max-top-n-tokens"
# The tokens to generate: at most --max-total-tokens less one (a prompt has at least one token)
MAX_NEW_TOKENS = "x-tgserve-max-new-tokens"
# OpenAI's n: at most --max-n (hidden; 16 by default)
MAX_N = "x-tgserve-max-n"
# Lists bounded by flags: stop strings (--max-stop-sequences), a batch of prompts (--max-client-batch-size)
MAX_STOP_SEQUENCES = "x-tgserve-max-stop-sequences"
MAX_CLIENT_BATCH = "x-tgserve-max-client-batch"
# The keyword each mark becomes: "maximum" unless named here.
BOUND_KEYWORDS = {MAX_STOP_SEQUENCES: "maxItems", MAX_CLIENT_BATCH: "maxItems"}
# An object keyed by token ids (OpenAI's logit_bias): its keys are written in decimal, below the
# vocabulary's size (TOKEN_ID's maximum), stated as a pattern
TOKEN_ID_KEYS = "x-tgserve-token-id-keys"
# A logit bias: OpenAI's range
MAX_LOGIT_BIAS = 100.0


def _variants(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return schema.get("anyOf", [schema])


def token_id_lists(schema: dict[str, Any]) -> None:
    """json_schema_extra of a list of token ids (optional or not)."""
    for variant in _variants(schema):
        if variant.get("type") == "array":
            variant["items"].update({"minimum": 0, TOKEN_ID: True})


def non_empty_prompt(schema: dict[str, Any]) -> None:
    """json_schema_extra of a prompt: text, token ids, or a batch of either, every form and every
    element at least one character or token long (an empty one is refused once tokenized: there is
    nothing to continue), token ids in the vocabulary."""
    for variant in _variants(schema):
        _non_empty(variant)
        if variant.get("type") == "array" and variant["items"].get("type") in ("string", "array"):
            variant[MAX_CLIENT_BATCH] = True  # a batch of prompts


def _non_empty(node: dict[str, Any]) -> None:
    kind = node.get("type")
    if kind == "string":
        node["minLength"] = 1
    elif kind == "integer":
        node.update({"minimum": 0, TOKEN_ID: True})
    elif kind == "array":
        node["minItems"] = 1
        _non_empty(node["items"])


def non_empty_stop(schema: dict[str, Any]) -> None:
    """json_schema_extra of stop strings (one or a list): none empty, at most --max-stop-sequences."""
    for variant in _variants(schema):
        if variant.get("type") == "string":
            variant["minLength"] = 1
        elif variant.get("type") == "array":
            variant["items"]["minLength"] = 1
            variant[MAX_STOP_SEQUENCES] = True


def number_bounds(**bounds: float):
    """json_schema_extra of an optional number whose range the server checks itself (with messages
    of its own): the schema states the bounds (minimum, maximum, exclusiveMinimum, ...)."""

    def extra(schema: dict[str, Any]) -> None:
        for variant in _variants(schema):
            if variant.get("type") in ("number", "integer"):
                variant.update(bounds)

    return extra


def flag_bound(mark: str):
    """json_schema_extra of an optional integer bounded by a flag: marked, filled by `fill_bounds`."""

    def extra(schema: dict[str, Any]) -> None:
        for variant in _variants(schema):
            if variant.get("type") == "integer":
                variant[mark] = True

    return extra


def fill_bounds(node: Any, maximums: dict[str, int]) -> None:
    """Every marked bound (in place, through the whole schema) given its maximum, {mark: maximum};
    a maximum the field states itself (chat's top_logprobs: 20) stays where it is the lower."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_KEYS, False):
            node["propertyNames"] = {"pattern": decimal_range_pattern(maximums[TOKEN_ID])}
        for mark, maximum in maximums.items():
            if node.pop(mark, False):
                keyword = BOUND_KEYWORDS.get(mark, "maximum")
                node[keyword] = min(maximum, node.get(keyword, maximum))
        for value in node.values():
            fill_bounds(value, maximums)
    elif isinstance(node, list):
        for value in node:
            fill_bounds(value, maximums)


def decimal_range_pattern(maximum: int) -> str:
    """A regular expression matching the integers 0 to `maximum` written in decimal, without
    leading zeros: the numbers with fewer digits, then for each digit of `maximum` those that agree
    with it before that digit and are smaller there, then `maximum` itself."""
    digits = str(maximum)
    width = len(digits)
    forms = ["0"] if width == 1 else ["0", f"[1-9][0-9]{{0,{width - 2}}}"]
    for i, digit in enumerate(digits):
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            rest = width - i - 1
            forms.append(f"{digits[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    forms.append(digits)
    return "^(" + "|".join(dict.fromkeys(forms)) + ")$"


def logit_biases(schema: dict[str, Any]) -> None:
    """json_schema_extra of OpenAI's optional logit_bias: token ids (decimal strings) to a bias in
    [-100, 100]."""
    for variant in _variants(schema):
        if variant.get("type") == "object":
            variant["additionalProperties"] = {
                "type": "number",
                "minimum": -MAX_LOGIT_BIAS,
                "maximum": MAX_LOGIT_BIAS,
            }
            variant[TOKEN_ID_KEYS] = True


def add_rule(schema: dict[str, Any], when: dict[str, Any], then: dict[str, Any]) -> None:
    """A rule between fields (`then` holds for a body `when` matches), beside the schema's others."""
    schema.setdefault("allOf", []).append({"if": when, "then": then})


def tools_for_tool_choice(schema: dict[str, Any]) -> None:
    """json_schema_extra of a chat request: a tool_choice other than "none" needs tools."""
    add_rule(
        schema,
        {
            "required": ["tool_choice"],
            "properties": {"tool_choice": {"not": {"anyOf": [{"const": "none"}, {"type": "null"}]}}},
        },
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    )


def top_logprobs_with_logprobs(schema: dict[str, Any]) -> None:
    """json_schema_extra of a chat request: top_logprobs of 1 or more needs logprobs true."""
    add_rule(
        schema,
        {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    )


# TGI's parameters when the answer streams (/generate_stream, or "stream": true): no prompt
# details, one sequence.
TGI_STREAM_PARAMETERS: dict[str, Any] = {
    "properties": {
        "decoder_input_details": {"const": False},
        "best_of": {"anyOf": [{"type": "null"}, {"type": "integer", "maximum": 1}]},
    }
}


def tgi_best_of_samples(schema: dict[str, Any]) -> None:
    """json_schema_extra of TGI's parameters: best_of > 1 samples (do_sample, or a warper away from
    its neutral value: `tgi_schemas.is_sampling`)."""
    samples = {
        "anyOf": [
            {"required": ["do_sample"], "properties": {"do_sample": {"const": True}}},
            {
                "required": ["temperature"],
                "properties": {"temperature": {"type": "number", "not": {"const": 1}}},
            },
            {"required": ["top_k"], "properties": {"top_k": {"type": "integer", "minimum": 1}}},
            {"required": ["top_p"], "properties": {"top_p": {"type": "number", "exclusiveMaximum": 1}}},
            {
                "required": ["typical_p"],
                "properties": {"typical_p": {"type": "number", "exclusiveMaximum": 1}},
            },
        ]
    }
    add_rule(
        schema,
        {"required": ["best_of"], "properties": {"best_of": {"type": "integer", "minimum": 2}}},
        samples,
    )


def tgi_streams_take_stream_parameters(schema: dict[str, Any]) -> None:
    """json_schema_extra of TGI's request: with "stream": true, TGI_STREAM_PARAMETERS."""
    add_rule(
        schema,
        {"required": ["stream"], "properties": {"stream": {"const": True}}},
        {"properties": {"parameters": TGI_STREAM_PARAMETERS}},
    )


def _whole(value: Any) -> Any:
    """16.0 is the integer 16 to JSON Schema, and so to the schema /openapi.json publishes: taken as
    such. 16.5, NaN and the infinities stay floats, which an integer field refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def whole(**bounds: int) -> Any:
    """The type of an integer field of a request body (strict models refuse 16.0 otherwise), with
    its bounds (ge, gt, le, lt) inside, where the schema states them as minimum and maximum (given
    to Field beside the validator, pydantic writes them as unknown keys)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]
