"""Reading a function-calling reply (`tools.py`) as far as it has been generated: each call's name
once it is complete and its arguments' text so far, or a plain answer's text so far. A stream sends
these as they grow, as OpenAI streams them; a whole reply is read the same way, so both carry the
same text. The grammar writes the reply on one line with fixed separators, so its layout is known
exactly: `{"tool_calls": [{"name": "N", "arguments": {...}}, ...]}` or `{"content": "..."}`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

CALLS = '{"tool_calls": ['
CONTENT = '{"content": "'
NAME = '{"name": "'
ARGUMENTS = '", "arguments": '
NEXT_CALL = "}, "


@dataclass(frozen=True)
class ScannedCall:
    name: str
    arguments: str  # the raw JSON text of its arguments so far
    complete: bool  # its arguments' object has closed


@dataclass(frozen=True)
class Scanned:
    """What a reply holds so far: calls, or content, or neither yet (too short to tell, or text not
    in the grammar's layout)."""

    calls: list[ScannedCall] | None = None
    content: str | None = None


def scan(text: str) -> Scanned:
    if text.startswith(CALLS):
        return Scanned(calls=_calls(text, len(CALLS)))
    if text.startswith(CONTENT):
        return Scanned(content=_string_so_far(text[len(CONTENT) :]))
    return Scanned()


def _calls(text: str, pos: int) -> list[ScannedCall]:
    calls = []
    while text.startswith(NAME, pos):
        start = pos + len(NAME)
        end = text.find('"', start)  # names are [A-Za-z0-9_-]: no escapes
        if end < 0 or not text.startswith(ARGUMENTS, end):
            break  # the name is not complete yet
        name, pos = text[start:end], end + len(ARGUMENTS)
        close = _object_end(text, pos)
        calls.append(ScannedCall(name, text[pos:close], close is not None))
        if close is None or not text.startswith(NEXT_CALL, close):
            break
        pos = close + len(NEXT_CALL)
    return calls


def _object_end(text: str, pos: int) -> int | None:
    """The index just past the JSON object that starts at `pos`, or None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _string_so_far(body: str) -> str:
    """A JSON string's text decoded up to its closing quote, or up to the last whole character when
    it is still open (an escape cut in the middle, or half of a surrogate pair, waits)."""
    i = 0
    while i < len(body):
        if body[i] == "\\":
            step = 6 if body[i + 1 : i + 2] == "u" else 2
            if i + step > len(body):
                break
            i += step
        elif body[i] == '"':
            break
        else:
            i += 1
    decoded = json.loads(f'"{body[:i]}"')
    if decoded and "\ud800" <= decoded[-1] <= "\udbff":
        decoded = decoded[:-1]
    return decoded


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def raw_content(scanned: Scanned) -> bool:
    """Whether a finished reply is sent as the text it is: it holds neither a call nor an answer (a
    stop string or max_tokens cut it before it could tell)."""
    return not scanned.calls and scanned.content is None


class ToolCallStream:
    """One choice's reply while it streams: what each piece of text adds, as OpenAI's delta."""

    def __init__(self) -> None:
        self.text = ""
        self.sent_arguments: list[int] = []  # per call whose id and name went out: its arguments' length sent
        self.sent_content = 0

    @property
    def calls_sent(self) -> bool:
        return bool(self.sent_arguments)

    def add(self, text: str) -> dict[str, Any]:
        self.text += text
        scanned = scan(self.text)
        if scanned.calls:
            return self._calls(scanned.calls)
        if scanned.content is not None:
            new, self.sent_content = scanned.content[self.sent_content :], len(scanned.content)
            return {"content": new} if new else {}
        return {}

    def finish(self) -> dict[str, Any]:
        """What is left once the reply has ended: text that never took the reply's layout, as content."""
        return {"content": self.text} if self.text and raw_content(scan(self.text)) else {}

    def _calls(self, calls: list[ScannedCall]) -> dict[str, Any]:
        entries: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if i == len(self.sent_arguments):  # its name is complete: id, type and name go first
                function = {"name": call.name, "arguments": call.arguments}
                entries.append({"index": i, "id": new_call_id(), "type": "function", "function": function})
            elif len(call.arguments) > self.sent_arguments[i]:
                entries.append(
                    {"index": i, "function": {"arguments": call.arguments[self.sent_arguments[i] :]}}
                )
            else:
                continue
            self.sent_arguments[i:] = [len(call.arguments)]
        return {"tool_calls": entries} if entries else {}
