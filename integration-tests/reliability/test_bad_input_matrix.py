"""Bad input on every route that takes a body: each route's minimal valid request, broken in one of
a dozen ways (not JSON, not UTF-8, empty, 50 MB, nested 100,000 deep, NaN and 1e400, an integer past
any limit, the wrong type, a list where an object goes, null), is answered with a 4xx whose error
says something, never a 5xx and never a hang; afterwards the server serves a good request.

`integration-tests/test_bad_inputs.py` (in `make test`) pins the exact status and words of the
commonest cases; this is the matrix, route by route, that `make reliability` runs. Prints the
statuses it saw.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import httpx

# Each route's text field (where the prompt goes) and its output-length field.
ROUTES: dict[str, tuple[Callable[[object], dict], Callable[[object], dict]]] = {
    "/generate": (lambda x: {"inputs": x}, lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n}}),
    "/generate_stream": (lambda x: {"inputs": x}, lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n}}),
    "/": (lambda x: {"inputs": x}, lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n}}),
    "/invocations": (lambda x: {"inputs": x}, lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n}}),
    "/tokenize": (lambda x: {"inputs": x}, lambda n: {"inputs": n}),
    "/v1/completions": (lambda x: {"prompt": x}, lambda n: {"prompt": "hi", "max_tokens": n}),
    "/v1/chat/completions": (
        lambda x: {"messages": [{"role": "user", "content": x}]},
        lambda n: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
    ),
}  # fmt: skip
NESTED = "[" * 100_000 + "]" * 100_000


def bad_bodies(route: str) -> dict[str, bytes]:
    """The broken forms of `route`'s request, as raw bodies."""
    text, length = ROUTES[route]
    good = json.dumps(text("hi"))
    return {
        "empty": b"",
        "not JSON": b"{not json",
        "null": b"null",
        "a list": b"[1, 2, 3]",
        "invalid UTF-8": good.replace('"hi"', '"\\u0068i"').encode().replace(b"\\u0068", b"\xff\xfe"),
        "the wrong type": json.dumps(text(12345)).encode(),
        "nested 100,000 deep": good.replace('"hi"', NESTED).encode(),
        "50 MB of text": good.replace('"hi"', json.dumps("word " * 10_000_000)).encode(),
        "NaN": json.dumps(length(1)).replace("1", "NaN", 1).encode(),
        "1e400": json.dumps(length(1)).replace("1", "1e400", 1).encode(),
        "10**40": json.dumps(length(10**40)).encode(),
        "-1": json.dumps(length(-1)).encode(),
    }  # fmt: skip


def error_text(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return ""
    if isinstance(error, dict):
        return str(error.get("message", ""))
    return str(error or "")


def test_every_route_answers_bad_input_with_a_4xx_naming_it(tiny_server):
    headers = {**tiny_server.headers, "content-type": "application/json"}
    seen: Counter = Counter()
    failures = []
    with httpx.Client(base_url=tiny_server.url, headers=headers, timeout=60) as client:
        for route in ROUTES:
            for name, body in bad_bodies(route).items():
                response = client.post(route, content=body)
                seen[response.status_code] += 1
                if not 400 <= response.status_code < 500 or not error_text(response):
                    failures.append(f"{route} {name}: {response.status_code} {response.text[:200]!r}")
        good = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    print(f"\nbad bodies: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
    assert not failures, "\n".join(failures)
    assert good.status_code == 200 and good.json()["generated_text"]
