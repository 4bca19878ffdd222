"""OpenAI response bodies and stream chunks, built from the router's sequence states and deltas."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tgserve.router.generation import Generation, SequenceState, TokenInfo, finite_or_none, finite_top
from tgserve.router.tokenization import RouterTokenizer
from tgserve.server.protocol.outputs import TokenLogprob

# TGI's finish reasons, in OpenAI's words.
FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length", "abort": "abort"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(generation: Generation) -> dict[str, int]:
    """Prompt tokens count once per prompt; completion tokens count every sequence generated."""
    completion = sum(len(seq.tokens) for seq in generation.sequences)
    prompt = generation.num_prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def envelope(kind: str, response_id: str, model: str, created: int | None = None) -> dict[str, Any]:
    """The fields every response and chunk starts with."""
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "system_fingerprint": None,
    }


def sequence_score(seq: SequenceState) -> float:
    return sum(t.logprob or 0.0 for t in seq.tokens)


def best_sequences(generation: Generation, prompt_index: int, n: int) -> list[SequenceState]:
    """The n sequences to return for one prompt: all of them, or the n most likely of best_of."""
    sequences = [s for s in generation.sequences if s.prompt_index == prompt_index]
    if len(sequences) > n:
        sequences = sorted(sequences, key=sequence_score, reverse=True)[:n]
    return sequences


# ---- /v1/completions -------------------------------------------------------------------------


def completion_logprobs(
    tokenizer: RouterTokenizer,
    tokens: list[TokenInfo],
    text_offset: int,
    prompt_ids: list[int] | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
) -> dict[str, Any]:
    """The legacy completions logprobs object; with echo, the prompt's tokens come first (the
    first one, which nothing predicts, with null)."""
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    prompt_ids = prompt_ids or []
    for token_id, entry in zip(prompt_ids, prompt_logprobs or [None] * len(prompt_ids), strict=True):
        text = tokenizer.token_text(token_id)
        logprob, top = None, None
        if entry is not None:
            logprob = finite_or_none(entry.logprob)
            top = {tokenizer.token_text(i): lp for i, lp in finite_top(entry.top)}
        _append_logprob(result, text, logprob, top, text_offset)
        text_offset += len(text)
    for token in tokens:
        text = tokenizer.token_text(token.id)
        top = {tokenizer.token_text(i): lp for i, lp in token.top}
        _append_logprob(result, text, token.logprob, top, text_offset)
        text_offset += len(token.text)
    return result


def _append_logprob(
    result: dict[str, list[Any]], text: str, logprob: float | None, top: dict[str, float] | None, offset: int
) -> None:
    result["tokens"].append(text)
    result["token_logprobs"].append(logprob)
    result["top_logprobs"].append(top)
    result["text_offset"].append(offset)


def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


# ---- /v1/chat/completions --------------------------------------------------------------------


def chat_logprobs(tokenizer: RouterTokenizer, tokens: list[TokenInfo]) -> dict[str, Any]:
    """`{"content": [...]}` with each token's text, log-probability, UTF-8 bytes and alternatives."""
    content = []
    for token in tokens:
        text = tokenizer.token_text(token.id)
        content.append(
            {
                "token": text,
                "logprob": token.logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                    for t, lp in ((tokenizer.token_text(i), lp) for i, lp in token.top)
                ],
            }
        )
    return {"content": content}


def chat_choice(
    index: int,
    text: str | None,
    logprobs: dict[str, Any] | None,
    reason: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole reply: its text, or the functions it calls (finish reason "tool_calls" once the reply
    is complete; "length" when max_tokens cut it)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
        reason = tool_calls_reason(reason)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def tool_calls_reason(reason: str | None) -> str | None:
    """A reply with calls that ended by itself (its grammar complete) finishes with "tool_calls"."""
    return "tool_calls" if reason in ("eos_token", "stop_sequence") else reason


def chat_chunk_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, reason: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
