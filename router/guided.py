"""Structured output as the APIs ask for it: OpenAI's `response_format` and TGI's `grammar`, each
turned into the engine's `GuidedDecoding` and compiled once here, so that a grammar that cannot be
used is the client's 4xx, naming the field and llguidance's reason, before it reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tgserve.router.errors import ValidationError
from tgserve.server.protocol.grammar import check_grammar
from tgserve.server.protocol.params import GuidedDecoding, InvalidRequestError

STRICT = ConfigDict(extra="ignore", strict=True)
# A JSON schema a reply can follow, as /openapi.json states it: an object, or `true` (any JSON).
# `false` allows no reply at all and is refused (400) before it reaches the engine.
SERVABLE_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "object"}, {"const": True}]}


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. The schema is enforced whatever `strict` says: a
    keyword that could not be enforced is refused rather than ignored."""

    model_config = STRICT

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (unconstrained), any JSON object, or JSON following a schema."""

    # The schema says what the server checks: type json_schema comes with its schema.
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {
                "required": ["json_schema"],
                "properties": {
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {"schema": SERVABLE_SCHEMA},
                    }
                },
            },
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class TGIGrammar(BaseModel):
    """TGI's `grammar`: `{"type": "json", "value": <a JSON schema, or its text>}` or
    `{"type": "regex", "value": "<a regular expression the whole output matches>"}`."""

    # The schema says what each type's value is: a JSON schema (SERVABLE_SCHEMA; the server also
    # takes its text; none: any JSON object) or a regular expression.
    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"type": {"enum": ["json", "json_object"]}}},
                    "then": {"properties": {"value": {"anyOf": [SERVABLE_SCHEMA, {"type": "null"}]}}},
                },
                {
                    "if": {"properties": {"type": {"const": "regex"}}},
                    "then": {"required": ["value"], "properties": {"value": {"type": "string"}}},
                },
            ]
        },
    )

    type: Literal["json", "json_object", "regex"]
    value: Any = None


def checked(spec: GuidedDecoding, param: str) -> GuidedDecoding:
    """`spec` once its grammar compiles; else a ValidationError naming `param` and the reason."""
    try:
        check_grammar(spec)
    except InvalidRequestError as exc:
        raise ValidationError(str(exc), param=param) from exc
    return spec


def _guided(kind: str, text: str, param: str) -> GuidedDecoding:
    try:
        spec = GuidedDecoding(kind, text)
    except InvalidRequestError as exc:
        raise ValidationError(str(exc), param=param) from exc
    return checked(spec, param)


def response_format_guided(fmt: ResponseFormat | None) -> GuidedDecoding | None:
    """The guided decoding a `response_format` asks for; None for text (or no response_format)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _guided("json_object", "", "response_format")
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if schema is None:
        raise ValidationError(
            "response_format of type 'json_schema' needs json_schema.schema", param="response_format"
        )
    return _guided("json_schema", json.dumps(schema), "response_format")


def grammar_guided(grammar: TGIGrammar | None) -> GuidedDecoding | None:
    """The guided decoding of TGI's `grammar` parameter; None when it is not given."""
    if grammar is None:
        return None
    value = grammar.value
    if grammar.type == "regex":
        if not isinstance(value, str):
            raise ValidationError("grammar of type 'regex' needs a string value", param="grammar")
        return _guided("regex", value, "grammar")
    if value is None:
        return _guided("json_object", "", "grammar")
    # TGI takes the schema as JSON or as a string of JSON.
    return _guided("json_schema", value if isinstance(value, str) else json.dumps(value), "grammar")
