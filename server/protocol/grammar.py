"""Guided decoding's grammars, compiled by llguidance: the one check that router and engine share.

llguidance is imported here only when a guided request arrives, so that neither process needs it to
serve unguided requests (nor imports it at start-up). Compiling a grammar without a tokenizer takes
well under a millisecond for the schemas of typical requests, so the router can afford to check
each request before it reaches the engine and answer a bad grammar with a message that names it.
"""

from __future__ import annotations

from tgserve.server.protocol.params import GuidedDecoding, InvalidRequestError

# OpenAI's json_object: any JSON object.
ANY_OBJECT_SCHEMA = '{"type": "object"}'


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # a server installed without it serves every other request
        raise InvalidRequestError(
            "guided decoding needs the llguidance package, which is not installed"
        ) from exc
    return llguidance


def grammar_text(spec: GuidedDecoding) -> str:
    """The llguidance grammar (its serialized form, what `LLMatcher` takes) for `spec`, unchecked."""
    matcher = _llguidance().LLMatcher
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.text)
    schema = spec.text if spec.kind == "json_schema" else ANY_OBJECT_SCHEMA
    try:
        return matcher.grammar_from_json_schema(schema)
    except ValueError as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from exc


def check_grammar(spec: GuidedDecoding) -> str:
    """Compile `spec` (without a tokenizer) and return its grammar; raise InvalidRequestError with
    llguidance's message for an invalid regex, an invalid or unsatisfiable schema, or a schema
    keyword that would not be enforced (llguidance's strict mode: nothing is silently ignored)."""
    grammar = grammar_text(spec)
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        what = "regular expression" if spec.kind == "regex" else "JSON schema"
        reason = "; ".join(_one_line(m) for m in messages)
        raise InvalidRequestError(f"the {what} cannot be used for guided decoding: {reason}")
    return grammar


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpts and carets (an error body is one line)."""
    lines = (line.strip() for line in message.splitlines())
    kept = [line for line in lines if any(c.isalpha() for c in line) and " | " not in line]
    return " ".join(kept) or message.strip()
