"""Request bodies: integers as JSON Schema defines them, and the rules the schema states."""

from __future__ import annotations

import re

import pytest

from tgserve.router.errors import ValidationError
from tgserve.router.http import parse_json
from tgserve.router.openai_schemas import CompletionRequest
from tgserve.router.schema_rules import TOKEN_ID, decimal_range_pattern, fill_bounds, non_empty_prompt
from tgserve.router.service_routes import DetokenizeRequest
from tgserve.router.tgi_schemas import TGIRequest


def test_a_whole_float_is_the_integer_and_a_fraction_is_refused() -> None:
    tgi = parse_json(TGIRequest, b'{"inputs": "x", "parameters": {"max_new_tokens": 4.0, "seed": 7.0}}')
    assert tgi.parameters.max_new_tokens == 4 and isinstance(tgi.parameters.max_new_tokens, int)
    assert parse_json(DetokenizeRequest, b'{"tokens": [1.0, 2]}').tokens == [1, 2]
    completion = parse_json(CompletionRequest, b'{"prompt": [[5.0, 6]], "max_tokens": 3.0, "n": 2.0}')
    assert (completion.prompt, completion.max_tokens, completion.n) == ([[5, 6]], 3, 2)
    for body in (b'{"tokens": [1.5]}', b'{"tokens": [true]}', b'{"tokens": ["1"]}', b'{"tokens": [1e400]}'):
        with pytest.raises(ValidationError, match="tokens"):
            parse_json(DetokenizeRequest, body)
    with pytest.raises(ValidationError, match="max_new_tokens"):
        parse_json(TGIRequest, b'{"inputs": "x", "parameters": {"max_new_tokens": 4.5}}')


def test_token_ids_are_marked_then_bounded_by_the_vocabulary() -> None:
    schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}
    non_empty_prompt(schema)
    fill_bounds(schema, {TOKEN_ID: 767})
    ids = schema["anyOf"][1]
    assert ids == {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": 767}}
    assert schema["anyOf"][0] == {"type": "string", "minLength": 1}


@pytest.mark.parametrize("maximum", [0, 7, 9, 10, 99, 100, 767, 1000, 49151])
def test_the_token_id_key_pattern_matches_exactly_the_ids_in_range(maximum: int) -> None:
    pattern = re.compile(decimal_range_pattern(maximum))
    for number in range(3 * maximum + 30):
        assert bool(pattern.search(str(number))) == (number <= maximum), number
    for written in ("00", "05", "-1", "+1", " 1", "1_0", "1.0", ""):
        assert not pattern.search(written), written
