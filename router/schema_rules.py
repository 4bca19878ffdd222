"""What the request bodies' schemas in /openapi.json state beyond pydantic's types: the rules the
server enforces that a schema can say (a prompt is never empty, a token id is in the vocabulary),
so that clients and fuzzers built from the schema send what the server takes.

Token ids are marked where a model's field is declared and bounded by the served model's
vocabulary when /openapi.json is built (`bound_token_ids`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

TOKEN_ID = "x-tgserve-token-id"  # a mark, replaced by [0, vocabulary) when /openapi.json is built


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


def bound_token_ids(node: Any, vocab_size: int) -> None:
    """Every marked token id (in place, through the whole schema) bounded by the vocabulary."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID, False):
            node["maximum"] = vocab_size - 1
        for value in node.values():
            bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            bound_token_ids(value, vocab_size)


def tools_for_tool_choice(schema: dict[str, Any]) -> None:
    """json_schema_extra of a chat request: a tool_choice other than "none" needs tools."""
    schema["if"] = {
        "required": ["tool_choice"],
        "properties": {"tool_choice": {"not": {"anyOf": [{"const": "none"}, {"type": "null"}]}}},
    }
    schema["then"] = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}


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
