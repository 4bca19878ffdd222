"""OpenAI's function calling: `tools`, `tool_choice`, `parallel_tool_calls`, enforced by a grammar.

As TGI does, the reply is JSON that guided decoding holds to the offered functions, whatever the
model's chat template knows of tools: `{"tool_calls": [{"name": ..., "arguments": {...}}]}`, at most
one call unless `parallel_tool_calls`, each call's arguments following its function's `parameters`
schema; with `tool_choice` "auto" the model may instead answer `{"content": "..."}`. The functions
reach the model twice: through the chat template's `tools` (templates that know them render them
their own way) and in an instruction that names the reply's format, which every template shows.
The reply is read back into `message.tool_calls` (arguments as a JSON string, as OpenAI sends them)
with finish_reason "tool_calls"; a stream sends each call's name and its arguments as they grow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tgserve.router.errors import ValidationError
from tgserve.router.guided import checked
from tgserve.router.tool_stream import new_call_id, raw_content, scan
from tgserve.server.protocol.params import GuidedDecoding

STRICT = ConfigDict(extra="ignore", strict=True)
NO_PARAMETERS = {"type": "object", "properties": {}}
# The reply's JSON around the calls is never sent, so its layout is free to choose: one line, with
# llguidance's fixed separators, spends no tokens on indentation (SmolLM2 otherwise pretty-printed
# until max_tokens cut it) and gives `tool_stream.py` an exact layout to read as it grows.
ONE_LINE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments follow `parameters` whatever it says


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: this function must be called."""

    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCalling:
    """The functions a request's reply may call, and how: its grammar and the instruction shown."""

    functions: list[FunctionDefinition]
    may_answer: bool  # tool_choice "auto": a plain answer instead of calls
    parallel: bool

    def guided(self) -> GuidedDecoding:
        """The reply's grammar, compiled once here: a `parameters` schema that cannot be enforced is a 400."""
        return checked(GuidedDecoding("json_schema", json.dumps(self.schema())), "tools")

    def schema(self) -> dict[str, Any]:
        definitions: dict[str, Any] = {}
        calls = [_call_schema(f, definitions) for f in self.functions]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        items: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            items["maxItems"] = 1
        reply = _object({"tool_calls": items})
        if self.may_answer:
            reply = {"anyOf": [reply, _object({"content": {"type": "string"}})]}
        return {**reply, "x-guidance": ONE_LINE, **({"$defs": definitions} if definitions else {})}

    def instruction(self) -> str:
        """The system instruction that shows the functions and the reply's format."""
        listed = json.dumps(
            [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]
        )
        many = "one or more calls" if self.parallel else "exactly one call"
        text = (
            f"You can call these functions:\n{listed}\n"
            f'Reply with JSON only: {{"tool_calls": [{{"name": <function name>, "arguments": {{<its arguments>}}}}]}}'
            f", with {many}."
        )
        if self.may_answer:
            text += ' When no function helps, reply {"content": <your answer>} instead.'
        return text


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _call_schema(function: FunctionDefinition, definitions: dict[str, Any]) -> dict[str, Any]:
    arguments = _rooted(function.name, function.parameters or NO_PARAMETERS, definitions)
    return _object({"name": {"const": function.name}, "arguments": arguments})


def _rooted(name: str, parameters: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters` as a part of the reply's schema. Its local `$ref`s point into its
    own document (`#/$defs/Item`, `#` itself, as pydantic writes them), which is no longer the root:
    the schema moves to the root's `$defs` under the function's name, its definitions beside it as
    `name.Item`, and every local reference is rewritten to match."""
    if "$ref" not in json.dumps(parameters) and not ({"$defs", "definitions"} & parameters.keys()):
        return parameters
    own = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    local = {**(parameters.get("definitions") or {}), **(parameters.get("$defs") or {})}
    definitions[name] = _rewrite_refs(own, name)
    for key, sub in local.items():
        definitions[f"{name}.{key}"] = _rewrite_refs(sub, name)
    return {"$ref": f"#/$defs/{name}"}


def _rewrite_refs(node: Any, name: str) -> Any:
    if isinstance(node, list):
        return [_rewrite_refs(item, name) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _rewrite_refs(value, name) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        path = ref[2:]
        for section in ("$defs/", "definitions/"):
            if path.startswith(section):
                out["$ref"] = f"#/$defs/{name}.{path[len(section) :]}"
                break
        else:
            out["$ref"] = f"#/$defs/{name}" + (f"/{path}" if path else "")
    return out


def tool_calling(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None
) -> ToolCalling | None:
    """What a request's `tools`, `tool_choice` and `parallel_tool_calls` ask for; None when the reply
    is plain text (no tools, or tool_choice "none"). A named function must be among the tools."""
    if not tools:
        if choice is not None and choice != "none":
            raise ValidationError("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise ValidationError("tools name a function more than once", param="tools")
    choice = choice or "auto"
    if choice == "none":
        return None
    functions = [t.function for t in tools]
    for function in functions:
        kind = (function.parameters or {}).get("type", "object")
        if kind != "object":
            raise ValidationError(
                f"the parameters of {function.name!r} must describe a JSON object (type 'object'), not {kind!r}",
                param="tools",
            )
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
        if not functions:
            raise ValidationError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools ({', '.join(names)})",
                param="tool_choice",
            )
    return ToolCalling(functions, may_answer=choice == "auto", parallel=parallel is not False)


@dataclass(frozen=True)
class ToolReply:
    """A reply read back: its calls in OpenAI's shape, or its plain content."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None


def read_reply(text: str) -> ToolReply:
    """A reply's calls (each as far as it got: a reply cut short by max_tokens has its last call's
    arguments cut too, as OpenAI's are), or its plain answer; text not in the grammar's layout (a
    stop string cut it before it could tell) stays content, as the model wrote it. Arguments are the
    reply's own text of them, which a stream sends piece by piece (`tool_stream.py`)."""
    scanned = scan(text)
    if raw_content(scanned):
        return ToolReply(text, None)
    if scanned.calls:
        return ToolReply(None, [openai_call(call.name, call.arguments) for call in scanned.calls])
    return ToolReply(scanned.content, None)


def openai_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
