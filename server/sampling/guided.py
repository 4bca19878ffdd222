"""Guided decoding on the engine side: a grammar matcher per guided request (llguidance's, or
xgrammar's with `--guided-decoding-backend xgrammar`; grammar_backends.py), and each step's token
masks for the rows of those requests.

Before sampling, every guided row gets a bitmask of the tokens its grammar allows next (the grammar
library fills them on the host, into one array per step, through its own thread pool: tens of
microseconds a row for a JSON schema); the sampler turns disallowed tokens' logits into -inf before any penalty,
warper or greedy pick. When the step's tokens are read, each matcher consumes its request's token,
and a request whose grammar is complete finishes ("eos_token"), as does one whose matcher is in
error: its grammar failed to compile, or it allows no token ("grammar_error"; such a row's mask
lets only the end-of-sequence tokens through, so its last token is one of those).

The runner computes a step's masks on a worker thread while the forward runs (`mask_bits`, one
call a step; the library's own threads fill the rows), and hands them to the sampler after it
(`token_mask`). That hides llguidance's share of the mask stage (1.2 of 8.2 ms a step for 64 rows
of SmolLM2 on two CPU cores); unpacking the bits and masking the logits stay in the sampler. With
async scheduling, a step whose guided requests have a token still in flight queues its forward
first (the token reaches it on the device), then reads that token on the host, lets the matchers
consume it and computes the masks while the device runs the forward; only the sampling waits for
them (as it waits for penalties' tokens).

A request's matcher is built (its grammar compiled: ~0.5 ms for a JSON schema with llguidance,
~6 ms with xgrammar, more for large schemas) on a worker thread from the step after the request
arrives (`prepare`); the engine schedules the request only once that is done (`is_prepared`), so a
slow grammar delays its own request, never a step of the batch.

A preempted request keeps its matcher, which still consumes the token that was in flight when it
was preempted (the scheduler keeps that token too), so a grammar completed by it ends the request
then. Should the matcher not match the tokens a request comes back with, it is built again from
them. Requests without a grammar never reach this module, so unguided batches pay nothing and
sample exactly as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tgserve.server.core.request import FinishReason
from tgserve.server.device.transfer import pinned_to, to_device
from tgserve.server.protocol.params import GuidedDecoding
from tgserve.server.sampling.grammar_backends import grammar_backend

logger = logging.getLogger(__name__)

# Returns the HF tokenizer and the model's end-of-sequence ids; called once, for the first guided request.
TokenizerLoader = Callable[[], tuple[Any, Iterable[int]]]


@dataclass
class TokenMask:
    """The allowed tokens of the batch rows `rows`: `bits` [len(rows), ceil(V / 32)] int32, on the
    logits' device, bit j of word w allowing token 32 w + j (the layout of both grammar libraries)."""

    rows: list[int]
    bits: torch.Tensor


def allowed_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] bool from packed bits; tokens past the mask's width (padded lm_heads) are not allowed."""
    if bits.device.type == "cpu":  # numpy's unpacking: 0.2 ms for 64 rows of SmolLM2's vocabulary, not 2.5
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(unpacked).view(torch.bool)
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """Logits with every token the mask disallows at -inf, in place (the sampler's own copy); rows
    without a grammar are untouched."""
    disallowed = ~allowed_tokens(mask.bits, logits.shape[-1])
    if len(mask.rows) == logits.shape[0]:
        return logits.masked_fill_(disallowed, float("-inf"))
    index = to_device(mask.rows, torch.int64, logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits


@dataclass
class _Guided:
    """One request's matcher (None when it could not be built), and how many output tokens it has consumed."""

    matcher: Any | None
    num_consumed: int = 0
    error: str = ""

    def failed(self) -> bool:
        if self.matcher is not None and not self.error and self.matcher.is_error():
            self.error = self.matcher.get_error()
        return bool(self.error)


def token_mask(bits: tuple[list[int], np.ndarray] | None, device: torch.device) -> TokenMask | None:
    """`GuidedMatchers.mask_bits`' rows and bits as the sampler takes them, on `device`."""
    if bits is None:
        return None
    rows, words = bits
    return TokenMask(rows, pinned_to(torch.from_numpy(words), device))


class PinnedMaskRows:
    """Pinned host arrays that steps' masks are filled into, two in turn, so that their copy to the
    device needs no pinned copy made each step (0.3-0.4 ms a step for 64 rows of a 49K-token
    vocabulary on an H200's host). An array is filled again two steps after it was: by then the
    step that copied it has been collected (the runner keeps at most one step in flight, and
    collects it before it fills the next step's masks or launches the one after), so its copy is done."""

    def __init__(self) -> None:
        self._arrays: list[torch.Tensor | None] = [None, None]
        self._next = 0

    def take(self, rows: int, width: int) -> np.ndarray:
        """A zeroed int32 [rows, width] array in pinned memory."""
        array = self._arrays[self._next]
        if array is None or array.shape[0] < rows or array.shape[1] != width:
            array = torch.empty((max(rows, 64), width), dtype=torch.int32, pin_memory=True)
            self._arrays[self._next] = array
        self._next = 1 - self._next
        bits = array[:rows].numpy()
        bits.fill(0)
        return bits


class GuidedMatchers:
    """The guided requests of one runner: their matchers, each step's masks, the tokens they consume.

    Nothing here raises for a request's grammar: a grammar that does not compile (or the grammar
    library missing) makes a matcher in error, which finishes its request and no other.
    """

    def __init__(
        self,
        load_tokenizer: TokenizerLoader | None,
        vocab_size: int,
        backend: str = "llguidance",
        pinned: bool = False,
    ) -> None:
        """pinned: fill the masks into pinned host memory (for a CUDA device: `PinnedMaskRows`)."""
        self._load_tokenizer = load_tokenizer
        self._mask_rows = PinnedMaskRows() if pinned else None
        self._vocab_size = vocab_size
        self._backend_name = backend
        self._backend: Any | None = None  # built with the tokenizer on first use (~0.3 s)
        self._backend_error: Exception | None = None  # why it could not be built: not tried again
        self._eos_ids: list[int] = []
        self._requests: dict[str, _Guided] = {}
        self._prepared: dict[str, Future] = {}  # matchers being built beside the loop (`prepare`)
        self._compiler: ThreadPoolExecutor | None = None
        self._backend_lock = threading.Lock()  # the backend is built once, by whichever thread first

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (the logits' width)."""
        return self._vocab_size

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def prepare(self, request_id: str, spec: GuidedDecoding) -> None:
        """Start building the request's matcher (compiling its grammar) on a worker thread."""
        if request_id in self._prepared or request_id in self._requests:
            return
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._prepared[request_id] = self._compiler.submit(lambda: self._grammar_backend().matcher(spec))

    def is_prepared(self, request_id: str) -> bool:
        """Whether the request's matcher is built (or failed to be): `add` takes it without waiting."""
        future = self._prepared.get(request_id)
        return future is not None and future.done()

    def wait_for_any(self, timeout_s: float) -> None:
        """Until one of the matchers being built is done, or `timeout_s` (an idle loop's pause)."""
        pending = [future for future in self._prepared.values() if not future.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def add(self, request_id: str, spec: GuidedDecoding, output_token_ids: Sequence[int] = ()) -> None:
        """Take the request's matcher (the one `prepare` built, else one built now) and let it
        consume the output the request already has; a preempted request coming back keeps the
        matcher it has when that one has seen its output."""
        kept = self._requests.get(request_id)
        if kept is not None and kept.num_consumed == len(output_token_ids):
            self._prepared.pop(request_id, None)
            return
        prepared = self._prepared.pop(request_id, None)
        try:
            matcher = prepared.result() if prepared is not None else self._grammar_backend().matcher(spec)
        except Exception as exc:  # ImportError, a tokenizer the library cannot read, a bad grammar
            self._requests[request_id] = _Guided(None, error=f"{type(exc).__name__}: {exc}")
            logger.warning("request %s: no grammar matcher: %s", request_id, exc)
            return
        guided = self._requests[request_id] = _Guided(matcher)
        if output_token_ids and matcher.consume_tokens(list(output_token_ids)):
            guided.num_consumed = len(output_token_ids)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._prepared.pop(request_id, None)  # a matcher still being built is dropped when done

    def _grammar_backend(self) -> Any:
        with self._backend_lock:
            if self._backend is None:
                if self._backend_error is not None:
                    raise self._backend_error
                try:
                    self._backend = self._build_backend()
                except Exception as exc:
                    self._backend_error = exc
                    raise
            return self._backend

    def _build_backend(self) -> Any:
        if self._load_tokenizer is None:
            raise RuntimeError("this engine was built without a tokenizer for guided decoding")
        hf_tokenizer, eos_ids = self._load_tokenizer()
        self._eos_ids = sorted(eos_ids)
        return grammar_backend(self._backend_name, hf_tokenizer, self._vocab_size, self._eos_ids)

    def mask(self, request_ids: Sequence[str], logits: torch.Tensor) -> TokenMask | None:
        """The masks of the guided requests among a step's sampled rows (`request_ids`, the rows
        of `logits`), or None when there are none."""
        return token_mask(self.mask_bits(request_ids, logits.shape[-1]), logits.device)

    def mask_bits(self, request_ids: Sequence[str], vocab: int) -> tuple[list[int], np.ndarray] | None:
        """Host work only, so a worker thread can do it while the forward runs: (the rows of the
        guided requests among `request_ids`, their bitmasks int32 [rows, words]), or None when
        there are none. `vocab`: the logits' width, used until the grammar library has a tokenizer."""
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self._requests]
        if not rows:
            return None
        # The library's width once it has a tokenizer (the larger of the model's and the tokenizer's).
        vocab = self._backend.vocab_size if self._backend is not None else vocab
        width = (vocab + 31) // 32
        if self._mask_rows is not None:
            bits = self._mask_rows.take(len(rows), width)
        else:
            bits = np.zeros((len(rows), width), dtype=np.int32)
        working = []
        for k, row in enumerate(rows):
            guided = self._requests[request_ids[row]]
            if guided.failed():
                self._allow_only_eos(bits[k])
            else:
                working.append((guided.matcher, k))
        if working:
            self._backend.fill(working, bits)
            filled = [k for _, k in working]
            for k in np.asarray(filled)[~bits[filled].any(axis=1)]:
                self._allow_only_eos(bits[k])  # nothing allowed: end the request on an end-of-sequence token
        return rows, bits

    def _allow_only_eos(self, row: np.ndarray) -> None:
        if not self._eos_ids:  # no tokenizer, so no known end token: one free token, then the end
            row[:] = -1
            return
        words = row.view(np.uint32)
        words[:] = 0
        for token_id in self._eos_ids:
            words[token_id // 32] |= np.uint32(1 << (token_id % 32))

    def consume(self, request_id: str, token_id: int) -> FinishReason | None:
        """The request's next output token is `token_id` (each step's tokens are read once):
        advance its matcher, and say whether the request ends here (grammar complete, or the
        matcher in error)."""
        return self.consume_step({request_id: token_id}).get(request_id)

    def consume_step(self, tokens: dict[str, int]) -> dict[str, FinishReason]:
        """A step's tokens, {request: its next output token}, consumed by the guided requests'
        matchers in one call to the grammar library (llguidance advances them on its threads):
        the requests that end here, and why (grammar complete, or the matcher in error)."""
        reasons, advancing = {}, []
        for request_id, token_id in tokens.items():
            guided = self._requests.get(request_id)
            if guided is None:
                continue
            if guided.failed():
                reasons[request_id] = self._failed(request_id, guided)
                continue
            guided.num_consumed += 1
            advancing.append((request_id, guided, token_id))
        if not advancing:
            return reasons
        accepted = self._backend.consume([(guided.matcher, token_id) for _, guided, token_id in advancing])
        for (request_id, guided, _), ok in zip(advancing, accepted, strict=True):
            if not ok:
                reasons[request_id] = self._failed(request_id, guided)
            elif guided.matcher.is_stopped():
                reasons[request_id] = FinishReason.EOS_TOKEN
        return reasons

    def _failed(self, request_id: str, guided: _Guided) -> FinishReason:
        guided.failed()
        logger.warning("request %s ends with grammar_error: %s", request_id, guided.error.strip())
        return FinishReason.GRAMMAR_ERROR
