"""Function calling through the real server and SmolLM2 with the official openai client: required,
named and automatic tool choice, one call or several, streamed and not; every call's arguments
follow its function's schema because the grammar holds them to it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)


def valid_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, once its arguments validate against its function's schema."""
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def test_required_tool_calls_streamed_and_not_are_the_same_valid_calls(client):
    # One call (parallel_tool_calls false): SmolLM2 allowed several sometimes repeats a call until max_tokens.
    args = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120, seed=1,
                temperature=0.8, parallel_tool_calls=False)  # fmt: skip
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = valid_calls(choice.message.tool_calls)
    assert calls

    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client):
    completion = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    calls = valid_calls(completion.choices[0].message.tool_calls)
    assert [name for name, _ in calls] == ["get_time"]


def test_auto_answers_or_calls_and_either_is_well_formed(client):
    for seed in range(2):
        completion = client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=1.0, seed=seed
        )
        choice = completion.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and valid_calls(choice.message.tool_calls)
        else:
            assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


def test_a_tool_result_is_answered(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}  # fmt: skip
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    completion = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert completion.choices[0].message.content and not completion.choices[0].message.tool_calls


def test_an_unknown_named_function_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )  # fmt: skip
    assert "launch" in caught.value.message and caught.value.body["param"] == "tool_choice"
