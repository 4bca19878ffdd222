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
    """json_schema_extra of stop strings (one or a list): none empty."""
    for variant in _variants(schema):
        if variant.get("type") == "string":
            variant["minLength"] = 1
        elif variant.get("type") == "array":
            variant["items"]["minLength"] = 1


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
    """Every marked bound (in place, through the whole schema) given its maximum, {mark: maximum}."""
    if isinstance(node, dict):
        for mark, maximum in maximums.items():
            if node.pop(mark, False):
                node["maximum"] = maximum
        for value in node.values():
            fill_bounds(value, maximums)
    elif isinstance(node, list):
        for value in node:
            fill_bounds(value, maximums)


def tools_for_tool_choice(schema: dict[str, Any]) -> None:
    """json_schema_extra of a chat request: a tool_choice other than "none" needs tools."""
    schema["if"] = {
        "required": ["tool_choice"],
        "properties": {"tool_choice": {"not": {"anyOf": [{"const": "none"}, {"type": "null"}]}}},
    }
    schema["then"] = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}


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
    schema["if"] = {"required": ["best_of"], "properties": {"best_of": {"type": "integer", "minimum": 2}}}
    schema["then"] = {
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


def tgi_streams_take_stream_parameters(schema: dict[str, Any]) -> None:
    """json_schema_extra of TGI's request: with "stream": true, TGI_STREAM_PARAMETERS."""
    schema["if"] = {"required": ["stream"], "properties": {"stream": {"const": True}}}
    schema["then"] = {"properties": {"parameters": TGI_STREAM_PARAMETERS}}


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
