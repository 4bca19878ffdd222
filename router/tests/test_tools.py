"""Function calling on /v1/chat/completions against the in-process fake engine: the grammar and the
instruction a request gets, the reply read back into tool_calls (whole and streamed), and the 400s."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from tgserve.router.app import create_app
from tgserve.router.tests.fakes import FakeEngineClient, make_state, text_script
from tgserve.router.tool_stream import ToolCallStream
from tgserve.router.tools import ToolReply, read_reply, tool_calling

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALLS = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]}'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def serve(tokenizer_dir, tokenizer, reply: str):
    eos = tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    client = FakeEngineClient(text_script(tokenizer, reply, eos), eos)
    state = make_state(tokenizer_dir, client, max_model_len=8192)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://test")
    return client, http


def parsed(tools, choice=None, parallel=None):
    from tgserve.router.openai_schemas import ChatCompletionRequest

    body = {"messages": MESSAGES, "tools": tools}
    body |= {} if choice is None else {"tool_choice": choice}
    body |= {} if parallel is None else {"parallel_tool_calls": parallel}
    request = ChatCompletionRequest.model_validate(body)
    return tool_calling(request.tools, request.tool_choice, request.parallel_tool_calls)


def test_the_grammar_holds_calls_to_the_offered_functions_and_their_arguments():
    schema = parsed([WEATHER, TIME], "required", parallel=False).schema()
    jsonschema.validate(json.loads(CALLS), schema)
    for bad in (
        '{"tool_calls": []}',  # required: at least one call
        '{"tool_calls": [{"name": "get_weather", "arguments": {"unit": "C"}}]}',  # city is required
        '{"tool_calls": [{"name": "launch", "arguments": {}}]}',  # not offered
        '{"content": "sunny"}',  # required: no plain answer
        '{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]}',
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(bad), schema)
    auto = parsed([WEATHER, TIME]).schema()  # auto and parallel by default
    jsonschema.validate({"content": "sunny"}, auto)
    jsonschema.validate(json.loads(CALLS.replace("]}", ', {"name": "get_time", "arguments": {}}]}')), auto)
    named = parsed([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(CALLS), named)
    assert parsed([WEATHER], "none") is None
    assert parsed([WEATHER, TIME], "required").guided().kind == "json_schema"  # llguidance compiles it


def test_parameters_with_their_own_definitions_and_recursion_keep_their_meaning():
    """pydantic writes `$defs` and `$ref`s local to the parameters; inside the reply's schema they
    still resolve, per function, and llguidance compiles them."""
    tree = {
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/Node"}, "copy": {"$ref": "#/properties/root"}},
        "required": ["root"],
        "$defs": {"Node": {"type": "object", "properties": {"label": {"type": "string"},
                                                            "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                           "required": ["label"], "additionalProperties": False}},
    }  # fmt: skip
    other = {
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/Node"}},
        "$defs": {"Node": {"type": "integer"}},
    }
    tools = [{"type": "function", "function": {"name": "plant", "parameters": tree}},
             {"type": "function", "function": {"name": "count", "parameters": other}}]  # fmt: skip
    calling = parsed(tools, "required")
    schema = calling.schema()
    good = {
        "name": "plant",
        "arguments": {"root": {"label": "a", "children": [{"label": "b", "children": []}]}},
    }
    jsonschema.validate({"tool_calls": [good, {"name": "count", "arguments": {"n": 3}}]}, schema)
    for bad in ({"root": {"label": "a", "children": [{"children": []}]}},  # a child without its label
                {"root": {"label": "a"}, "copy": {"label": 1}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"tool_calls": [{"name": "plant", "arguments": bad}]}, schema)
    with pytest.raises(jsonschema.ValidationError):  # the other function's Node is an integer
        jsonschema.validate({"tool_calls": [{"name": "count", "arguments": {"n": {"label": "x"}}}]}, schema)
    assert calling.guided().kind == "json_schema"


@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_add_up_to_the_whole_reply_wherever_the_text_is_cut(seed):
    calls = ('{"tool_calls": [{"name": "a", "arguments": {"s": "x\\"}{y]", "n": [1, {"k": 2}]}}, '
             '{"name": "b_2", "arguments": {}}]}')  # fmt: skip
    answer = '{"content": "caf\\u00e9 \\ud83d\\ude00 \\"q\\" \\\\ end"}'
    rng = random.Random(seed)
    for reply in (calls, answer):
        cuts = sorted(rng.sample(range(1, len(reply)), 12))
        stream, sent = ToolCallStream(), []
        for lo, hi in zip([0, *cuts], [*cuts, len(reply)]):
            sent.append(stream.add(reply[lo:hi]))
        sent.append(stream.finish())
        whole = read_reply(reply)
        if whole.tool_calls:
            names = [e["function"]["name"] for d in sent for e in d.get("tool_calls", []) if "id" in e]
            assert names == ["a", "b_2"] == [c["function"]["name"] for c in whole.tool_calls]
            for i, call in enumerate(whole.tool_calls):
                args = "".join(
                    e["function"]["arguments"]
                    for d in sent
                    for e in d.get("tool_calls", [])
                    if e["index"] == i
                )
                assert args == call["function"]["arguments"]
                json.loads(args)
        else:
            assert (
                "".join(d.get("content", "") for d in sent) == whole.content == json.loads(reply)["content"]
            )


def test_a_reply_cut_short_stays_content():
    reply = read_reply(CALLS)
    assert reply.content is None and reply.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert reply.tool_calls[0]["id"].startswith("call_")
    assert read_reply(CALLS[:30]) == ToolReply(CALLS[:30], None)
    assert read_reply('{"content": "sunny"}').content == "sunny"
    # max_tokens cut the arguments: the call comes back as far as it got, as OpenAI's do
    cut = read_reply(CALLS[:70])
    assert cut.content is None and cut.tool_calls[0]["function"]["arguments"] == CALLS[53:70]


async def test_tool_calls_whole_and_streamed(tokenizer_dir, tokenizer):
    engine, http = serve(tokenizer_dir, tokenizer, CALLS)
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required"}
    whole = (await http.post("/v1/chat/completions", json=body)).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    # The engine got the grammar, and the prompt shows the functions and the reply's format.
    _, prompt, params = engine.submitted[-1]
    assert params.guided is not None and params.guided.kind == "json_schema"
    assert "get_time" in tokenizer.decode(prompt) and '"tool_calls"' in tokenizer.decode(prompt)

    response = await http.post("/v1/chat/completions", json=body | {"stream": True})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[0]["delta"]["role"] == "assistant"
    # The id and name first, then the arguments as they grow; the last chunk says tool_calls.
    pieces = [entry for d in deltas for entry in d["delta"].get("tool_calls") or []]
    assert (
        len(pieces) > 2
        and pieces[0]["id"].startswith("call_")
        and pieces[0]["function"]["name"] == "get_weather"
    )
    assert all(p["index"] == 0 and "id" not in p for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not any(d["delta"].get("content") for d in deltas)


async def test_auto_may_answer_in_plain_text(tokenizer_dir, tokenizer):
    _, http = serve(tokenizer_dir, tokenizer, '{"content": "It is sunny."}')
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"


async def test_earlier_calls_and_results_reach_the_template(tokenizer_dir, tokenizer):
    engine, http = serve(tokenizer_dir, tokenizer, '{"content": "It is 21 C."}')
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    response = await http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    assert "21 C" in tokenizer.decode(engine.submitted[-1][1])


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "json_object"}}, "response_format", "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "x",
                            "parameters": {
                                "type": "object",
                                "properties": {"xs": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ]
            },
            "tools",
            "uniqueItems",
        ),  # fmt: skip
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "name"),
        (
            {"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]},
            "tools",
            "JSON object",
        ),  # fmt: skip
    ],
)
async def test_tool_requests_that_cannot_be_served_are_400s_naming_the_field(
    tokenizer_dir, tokenizer, extra, param, needle
):
    _, http = serve(tokenizer_dir, tokenizer, CALLS)
    body = {"messages": MESSAGES, "tools": [WEATHER]} | extra
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and (error.get("param") or "").startswith(param)
