"""The messages between the router process and the engine process (ZMQ over ipc://, msgpack).

One PUSH/PULL pair each way: the router pushes `RouterMessage`s, the engine pushes `EngineMessage`s.
Payload types are the engine's own dataclasses (`SamplingParams`, `RequestOutput`, `EngineStats`):
msgspec encodes and decodes dataclasses natively, so there is no second copy of them to keep in sync,
and decoding `SamplingParams` runs its `__post_init__` validation again on the engine side.

This module and `engine/service.py` are the only engine-side modules that import msgspec; nothing in
the engine imports them, so the engine stays usable without the router's packages.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tgserve.server.protocol.outputs import EngineStats, RequestOutput
from tgserve.server.protocol.params import SamplingParams

# ---- the launcher -> the engine process ------------------------------------------------------


class EngineServiceConfig(msgspec.Struct, frozen=True):
    """What the launcher tells the engine process: where to connect and how to build the engine.

    engine_args are the keyword arguments of `EngineArgs`; parent_pid lets an orphaned engine exit.
    tokenizer_dir: where to save the engine's tokenizer for the router, which loads it from there
    without torch (and so tokenizes exactly as the engine would).
    """

    input_address: str
    output_address: str
    engine_args: dict[str, Any]
    parent_pid: int
    tokenizer_dir: str | None = None


# ---- router -> engine ------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    """A tokenized prompt to generate from. The router has validated it against its limits."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag="abort"):
    """Drop these requests and free their KV blocks (client gone, or a sibling of `n` failed)."""

    request_ids: list[str]


class FinishRequest(msgspec.Struct, tag="finish"):
    """The router saw a stop string: finish the request with this reason and free its blocks."""

    request_id: str
    reason: str


class Ping(msgspec.Struct, tag="ping"):
    """Answered with a `Pong` by the engine loop between two steps; `/health` uses it."""

    ping_id: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Exit the engine loop cleanly (status 0)."""


RouterMessage = AddRequest | AbortRequests | FinishRequest | Ping | Shutdown

# ---- engine -> router ------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once, after the model is loaded and warmed up: what the router needs to serve it."""

    model_id: str
    max_model_len: int
    eos_token_ids: list[int]
    pid: int
    dtype: str = ""
    device: str = ""
    num_total_blocks: int = 0
    block_size: int = 0
    tokenizer_dir: str = ""  # the engine's tokenizer, saved for the router to load
    kv_cache_dtype: str = ""  # what the KV cache stores (bfloat16, float8_e4m3fn, ...)
    # The longest context one request can have: the model's length, or what the KV pool holds if
    # less (0: not said; the model's length).
    max_servable_tokens: int = 0


class StepOutputs(msgspec.Struct, tag="outputs"):
    """The deltas of one engine step; `stats` rides along at most every few tens of milliseconds."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent while idle, so the router's metrics stay current and it knows the loop is alive."""

    stats: EngineStats


class RequestRejected(msgspec.Struct, tag="rejected"):
    """`add_request` refused a request. kind: "validation" (InvalidRequestError) or "generation"."""

    request_id: str
    message: str
    kind: str = "validation"


class Pong(msgspec.Struct, tag="pong"):
    ping_id: int


class EngineFailed(msgspec.Struct, tag="failed"):
    """A fatal error: the engine process exits non-zero right after sending this."""

    message: str


EngineMessage = EngineReady | StepOutputs | Heartbeat | RequestRejected | Pong | EngineFailed

# ---- codecs ----------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_router_decoder = msgspec.msgpack.Decoder(RouterMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(message: RouterMessage | EngineMessage) -> bytes:
    """Serialize either direction's message."""
    return _encoder.encode(message)


def decode_router_message(data: bytes) -> RouterMessage:
    """Decode what the router sent (on the engine side). Raises msgspec.ValidationError on bad data."""
    return _router_decoder.decode(data)


def decode_engine_message(data: bytes) -> EngineMessage:
    """Decode what the engine sent (on the router side)."""
    return _engine_decoder.decode(data)
