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

The runner starts a step's masks on worker threads while the forward runs (`start_masks`: one job
for the step's rows, the library's own threads filling them; a new request, or one whose masks were
late or slow, in a job of its own until a mask of its comes in time and quick), and hands them to
the sampler after it (`StepMasks.gather`, `token_mask`). A mask not ready `LATE_MASK_GRACE_S` after
the logits (or half the step so far, where steps are long) is late: the step samples without it,
and its request gets no token from that step (the runner defers it; the scheduler computes that
position again later), so a slow mask delays its own request, not the batch. The late job goes on,
and its mask serves the request's next try (its grammar has not moved); until then the engine
holds the request out of steps (`waiting_for_masks`).

Computing masks beside the forward hides llguidance's share of the mask stage (1.2 of 8.2 ms a step
for 64 rows of SmolLM2 on two CPU cores); unpacking the bits and masking the logits stay in the
sampler. With
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
import time
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

# How long the sampler waits for guided masks once the step's logits are ready: a mask later than
# that is late, and its request gets no token this step (`StepMasks.gather`). Masks take tens of
# microseconds a row; this leaves room for a loaded host without letting one grammar hold the batch.
LATE_MASK_GRACE_S = 0.005
# Threads computing masks: a late job keeps its thread until it ends, and the next steps' jobs run
# beside it on the others.
MASK_WORKERS = 4
# Where a step is long, masks are waited for past the logits this share of the step so far (from
# its launch to its logits), at most MAX_MASK_GRACE_S: deferring a request costs it a step or more,
# which on a slow device is worth far more than a few milliseconds of waiting.
MASK_GRACE_STEP_FRACTION = 0.5
MAX_MASK_GRACE_S = 1.0
# How often the sampler looks whether the device has finished the forward while masks are missing.
_POLL_S = 0.0005
# A request filled alone joins the step's shared job once a mask of its own came in time and took
# less than this to fill: a grammar whose masks are slow stays alone and holds back only itself,
# while requests split off by a passing stall of the host (a garbage collection) share again next step.
QUICK_MASK_S = 0.001


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


def mask_grace_s(grace_s: float, step_started: float | None) -> float:
    """How long masks are waited for once the logits are ready: `grace_s`, or where the step so far
    (since `step_started`, a perf_counter time) is longer, MASK_GRACE_STEP_FRACTION of it, at most
    MAX_MASK_GRACE_S."""
    if step_started is None:
        return grace_s
    so_far = time.perf_counter() - step_started
    return max(grace_s, min(MASK_GRACE_STEP_FRACTION * so_far, MAX_MASK_GRACE_S))


@dataclass
class _MaskJob:
    """Masks being filled on a worker thread: `future` gives (int32 [len(request_ids), words], the
    seconds the fill took), row k for request_ids[k] as its matcher stood after `consumed[k]` tokens."""

    future: Future
    request_ids: list[str]
    consumed: list[int]
    was_late: bool = False  # a step found it unfinished

    def bits(self) -> np.ndarray:
        return self.future.result()[0]  # raises what the job raised

    def quick_alone(self) -> bool:
        """A one-request job, never late, filled in under QUICK_MASK_S."""
        return len(self.request_ids) == 1 and not self.was_late and self.future.result()[1] < QUICK_MASK_S


class StepMasks:
    """The masks of a step's guided rows (`rows` of the step's sampled rows), from the jobs filling
    them: the step's own, or a job of an earlier step that was late for a request still waiting
    at the same point of its grammar."""

    def __init__(
        self,
        owner: GuidedMatchers,
        rows: list[int],
        placed: list[tuple[_MaskJob, int]],
        width: int,
        one_job_in_order: bool = False,
    ):
        """placed: each row's job and its row there; one_job_in_order: all rows are one job's, in its order."""
        self._owner, self.rows, self._placed, self._width = owner, rows, placed, width
        self._one_job_in_order = one_job_in_order

    def gather(
        self, logits_ready: Callable[[], bool], grace_s: float | None, step_started: float | None = None
    ) -> tuple[tuple[list[int], np.ndarray] | None, set[str]]:
        """((rows, bits) of the masks ready in time, or None), and the requests whose masks were late.

        Waits while the device computes the logits (`logits_ready` false: nobody waits for the
        masks yet), then at most `mask_grace_s(grace_s, step_started)` more; grace_s None waits
        for every mask. Which were in time goes to the owner (`note_timing`): it decides which
        requests share jobs."""
        jobs = {id(job): job for job, _ in self._placed}  # usually one, for every row
        pending = {job.future for job in jobs.values() if not job.future.done()}
        if pending and grace_s is None:
            wait(pending)
        elif pending:
            while not logits_ready() and wait(pending, timeout=_POLL_S).not_done:
                pass
            wait(pending, timeout=mask_grace_s(grace_s, step_started))
        done = {key: job.future.done() for key, job in jobs.items()}  # one look a job: it may end meanwhile
        for key, job in jobs.items():
            job.was_late |= not done[key]
        if self._one_job_in_order and all(done.values()):
            return self._one_job()
        rows, late, by_job = [], set(), {}
        for row, (job, k) in zip(self.rows, self._placed, strict=True):
            if not done[id(job)]:
                late.add(job.request_ids[k])
                continue
            _, into, taken = by_job.setdefault(id(job), (job, [], []))
            into.append(len(rows))
            taken.append(k)
            rows.append(row)
        quick = [job.request_ids[0] for job, _, _ in by_job.values() if job.quick_alone()]
        self._owner.note_timing(quick, late)
        if not rows:
            return None, late
        bits = self._owner.mask_array(len(rows), self._width)
        for job, into, taken in by_job.values():  # one copy a job (usually one job, all rows)
            bits[into] = job.bits()[taken]
        return (rows, bits), late

    def _one_job(self) -> tuple[tuple[list[int], np.ndarray], set[str]]:
        """Every row from one job, ready, in its order (the usual step): one copy."""
        job = self._placed[0][0]
        if job.quick_alone():
            self._owner.note_timing(job.request_ids, ())
        bits = self._owner.mask_array(len(self.rows), self._width)
        bits[:] = job.bits()
        return (self.rows, bits), set()


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
        self._mask_pool: ThreadPoolExecutor | None = None  # `start_masks`' jobs
        self._mask_jobs: dict[str, tuple[_MaskJob, int]] = {}  # request -> its latest job, its row there
        self._sharing: set[str] = set()  # requests whose masks share the step's job (`note_timing`)

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

    def wait_for_compiles(self) -> None:
        """Until every matcher being built is done: a caller that wants the step a guided request
        joins to be the same on any host (a test of the schedule) waits here before each step."""
        wait(list(self._prepared.values()))

    def wait_for_any(self, timeout_s: float) -> None:
        """Until one of the matchers being built, or of the masks deferred requests wait for, is
        done, or `timeout_s` (an idle loop's pause)."""
        pending = [future for future in self._prepared.values() if not future.done()]
        pending += self._awaited_masks().values()
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
        self._mask_jobs.pop(request_id, None)  # filled from the matcher replaced here
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
        self._mask_jobs.pop(request_id, None)  # a job still running ends unread
        self._sharing.discard(request_id)

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

    def start_masks(self, request_ids: Sequence[str], vocab: int) -> StepMasks | None:
        """Start filling the masks of the guided requests among a step's sampled rows
        (`request_ids`) on worker threads, to be gathered after the forward; None when there are
        none. Requests waiting at the point of their grammar an earlier step's job was late for
        take that job's mask. Requests sharing (`note_timing`) share one job; the others, new ones
        (a first mask builds the grammar library's states: the likeliest to be slow) and those whose
        masks were late or slow, get a job each, so a slow mask holds back only its own request."""
        if not self._requests:
            return None
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self._requests]
        if not rows:
            return None
        width = self._width(vocab)
        guided_ids = [request_ids[row] for row in rows]
        if not self._mask_jobs.keys() & guided_ids and self._sharing.issuperset(guided_ids):
            # the usual step: one job for every row
            job = self._submit_masks(guided_ids, width)
            return StepMasks(self, rows, [(job, k) for k in range(len(rows))], width, one_job_in_order=True)
        shared = []
        for row in rows:
            request_id = request_ids[row]
            kept = self._mask_jobs.get(request_id)
            if kept is not None and kept[0].consumed[kept[1]] == self._requests[request_id].num_consumed:
                continue  # the mask an earlier step was late for
            if request_id in self._sharing:
                shared.append(request_id)
            else:
                self._submit_masks([request_id], width)
        if shared:
            self._submit_masks(shared, width)
        return StepMasks(self, rows, [self._mask_jobs[request_ids[row]] for row in rows], width)

    def _submit_masks(self, request_ids: list[str], width: int) -> _MaskJob:
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=MASK_WORKERS, thread_name_prefix="guided-masks")
        guided = [self._requests[request_id] for request_id in request_ids]
        future = self._mask_pool.submit(
            self._timed_fill, guided, np.zeros((len(guided), width), dtype=np.int32)
        )
        job = _MaskJob(future, request_ids, [g.num_consumed for g in guided])
        self._mask_jobs.update((request_id, (job, k)) for k, request_id in enumerate(request_ids))
        return job

    def waiting_for_masks(self) -> set[str]:
        """Requests deferred for a mask still being computed: a step would only defer them again."""
        return set(self._awaited_masks())

    def _awaited_masks(self) -> dict[str, Future]:
        """The unfinished late jobs, by request: what deferred requests wait for."""
        return {
            request_id: job.future
            for request_id, (job, _) in self._mask_jobs.items()
            if job.was_late and not job.future.done()
        }

    def note_timing(self, quick: Iterable[str], late: Iterable[str]) -> None:
        """Requests whose masks, filled alone, came in time and quick: they share the step's job
        from now on; requests whose masks were late: filled alone from now on."""
        self._sharing.update(request_id for request_id in quick if request_id in self._requests)
        self._sharing.difference_update(late)

    def _timed_fill(self, requests: list[_Guided], bits: np.ndarray) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        return self._fill(requests, bits), time.perf_counter() - start

    def mask_array(self, rows: int, width: int) -> np.ndarray:
        """A zeroed int32 [rows, width] array for a step's masks (pinned where `pinned`)."""
        if self._mask_rows is not None:
            return self._mask_rows.take(rows, width)
        return np.zeros((rows, width), dtype=np.int32)

    def _width(self, vocab: int) -> int:
        # The library's width once it has a tokenizer (the larger of the model's and the tokenizer's).
        vocab = self._backend.vocab_size if self._backend is not None else vocab
        return (vocab + 31) // 32

    def mask_bits(self, request_ids: Sequence[str], vocab: int) -> tuple[list[int], np.ndarray] | None:
        """Host work only: (the rows of the guided requests among `request_ids`, their bitmasks
        int32 [rows, words]), or None when there are none. `vocab`: the logits' width, used until
        the grammar library has a tokenizer."""
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self._requests]
        if not rows:
            return None
        bits = self.mask_array(len(rows), self._width(vocab))
        return rows, self._fill([self._requests[request_ids[row]] for row in rows], bits)

    def _fill(self, requests: list[_Guided], bits: np.ndarray) -> np.ndarray:
        """Row k of `bits` gets the mask of requests[k]: what its grammar allows next, or only the
        end-of-sequence tokens where its matcher failed or allows nothing."""
        working = []
        for k, guided in enumerate(requests):
            if guided.failed():
                self._allow_only_eos(bits[k])
            else:
                working.append((guided.matcher, k))
        if working:
            self._backend.fill(working, bits)
            filled = [k for _, k in working]
            for k in np.asarray(filled)[~bits[filled].any(axis=1)]:
                self._allow_only_eos(bits[k])  # nothing allowed: end the request on an end-of-sequence token
        return bits

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
            self._mask_jobs.pop(request_id, None)  # its mask is used
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
