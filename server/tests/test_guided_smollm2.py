"""Guided decoding with the real SmolLM2-135M-Instruct: sampled completions under a JSON schema all
parse and validate, a regex grammar's outputs match it, and unguided requests sharing the batch get
the tokens they get alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tgserve.server.engine.llm import LLM
from tgserve.server.protocol.params import GuidedDecoding, SamplingParams
from tgserve.server.testing.smollm2 import smollm2_checkpoint

pytestmark = pytest.mark.slow

# Nested objects, enums, an array with bounds, required fields; small, so that answers stay short.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                "country": {"enum": ["FR", "DE", "US"]},
            },
            "required": ["zip", "country"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "late"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}
# Sampled answers beside the unguided ones in one batch; the fifty the acceptance asks for are
# sampled through the server (integration-tests/test_guided_decoding.py).
NUM_JSON = 16
UNGUIDED = [
    SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=11, max_new_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=12, top_p=0.9, max_new_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.0, max_new_tokens=16, repetition_penalty=1.2, ignore_eos=True),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(smollm2_checkpoint()), dtype="float32")


def chat(llm: LLM, content: str) -> str:
    messages = [{"role": "user", "content": content}]
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_sampled_json_completions_all_validate_and_plain_neighbours_are_unchanged(llm: LLM) -> None:
    prompt = chat(llm, "Describe a user of a web shop as JSON: name, role, address and tags.")
    guided = GuidedDecoding("json_schema", json.dumps(PERSON))
    json_params = [
        SamplingParams(temperature=0.8, seed=seed, max_new_tokens=120, guided=guided)
        for seed in range(NUM_JSON)
    ]
    plain_prompts = [
        chat(llm, "Tell me about the sea."),
        "The capital of France is",
        "def add(a, b):",
        "Once",
    ]
    alone = llm.generate(plain_prompts, UNGUIDED)
    together = llm.generate([prompt] * NUM_JSON + plain_prompts, json_params + UNGUIDED)
    for out in together[:NUM_JSON]:
        assert out.finish_reason == "eos_token", out
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({out.text for out in together[:NUM_JSON]}) > NUM_JSON // 2  # sampled, not one answer
    for expected, got in zip(alone, together[NUM_JSON:], strict=True):
        assert got.token_ids == expected.token_ids


def test_a_regex_grammar_is_matched(llm: LLM) -> None:
    prompt = chat(llm, "When was the first moon landing? Answer with the date only.")
    regex = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_new_tokens=24, guided=GuidedDecoding("regex", regex))
        for seed in range(4)
    ]
    for out in llm.generate([prompt] * len(params), params):
        assert out.finish_reason == "eos_token" and re.fullmatch(regex, out.text), out


def test_json_object_mode_writes_a_json_object(llm: LLM) -> None:
    prompt = chat(llm, "Give me a JSON object with your name and age.")
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=80, guided=GuidedDecoding("json_object"))
    )
    assert out[0].finish_reason == "eos_token" and isinstance(json.loads(out[0].text), dict)
