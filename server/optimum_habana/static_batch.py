"""Static-batch decoding through a `StaticCache`, the way tgi-gaudi drives optimum-habana models.

`StaticBatch` holds the batch mechanics every driver shares: requests are prefilled one at a time and
inserted into free rows (shifting the batch right when a prompt is longer than the used width), every
decode step feeds one token per row with the attention mask and per-row position ids, finished rows
are filtered out, and when the static length is used up the batch shifts left by its common leading
padding. It never touches a layout's tensors: all it knows is `StaticCache` and the layout's standard
views. Two drivers use it: `StaticBatchGenerator` here (greedy, whole batches, for tests of the
mechanics) and `tgserve.server.optimum_habana.engine.StaticBatchEngine` (the serving engine).

On CPU this drives any transformers causal LM through any layout; the tests run the tiny GPT-BigCode
model through the fused multi-query layout against transformers `generate`. On a Gaudi, optimum-habana's
own classes take the layout's tensors directly; only `forward_step` would differ.

Static shapes: on a Gaudi every new forward input shape is a graph compile (seconds). A prefill is
left-padded to its prompt-length bucket (tgi-gaudi's PAD_SEQUENCE_TO_MULTIPLE_OF) and a decode step
always reads the whole static width, so `warm_up` can run every shape serving will meet; `shapes`
logs the shapes met, so tests can check that serving after warmup meets no new one.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from tqdm import tqdm

from tgserve.server.config.buckets import BucketConfig
from tgserve.server.static_shapes.buckets import bucket_for, token_buckets
from tgserve.server.static_shapes.padding import ShapeLog

from .cache_layouts import KV, CacheLayout
from .static_cache import StaticCache

logger = logging.getLogger(__name__)

Row = TypeVar("Row")  # what a driver keeps per occupied row (its request object)


def forward_step(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    past: list[KV],
) -> tuple[torch.Tensor, list[KV]]:
    """Run `model` on `input_ids` `[B, T]` after `past`; return the logits of every input position
    `[B, T, vocab]` and the new keys/values.

    The one place that knows transformers' cache API. Since 4.54 upstream modeling code, GPT-BigCode's
    included (its fused `[B, S, 2*D]` past went away then), reads and writes a Cache object holding
    `[B, kv_heads, S, D]` keys and values, so the layout's standard views are copied into a
    `DynamicCache` and the new positions read back from its layers. Only `DynamicCache()`, `update` and
    `layers[i].keys / .values` are used: transformers 4.55 (the Gaudi image) and 5.x both have them.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    for index, (keys, values) in enumerate(past):
        cache.update(keys, values, index)
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{_cache_argument(model): cache},
    )
    steps = input_ids.shape[1]
    new_kv = [(layer.keys[:, :, -steps:], layer.values[:, :, -steps:]) for layer in cache.layers]
    return output.logits, new_kv


def _cache_argument(model: Any) -> str:
    """The name `forward` takes the cache under.

    transformers 5.x renamed `past_key_values` to `cache` (the old name still works, with a warning,
    until 5.40); 4.55 knows only `past_key_values`.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prompt_buckets(config: BucketConfig, max_len: int) -> list[int]:
    """The lengths prompts are left-padded to, up to the longest prompt a row of `max_len` holds
    (`max_len - 1`): multiples of `token_step` (linear) or powers of two from it (exponential)."""
    return token_buckets(config, max_len - 1)


class StaticBatch(Generic[Row]):
    """The rows of one static cache of `rows` x `max_len` positions and what occupies them.

    `running[i]` occupies row i: `retire` keeps them a prefix, `insert` appends. A driver must never
    let an occupied row hold `max_len` positions, so that `decode` can always shift a padding column
    out: a sequence of prompt + generated tokens holds one position fewer than its length (its last
    token is not fed yet), so stopping every sequence at `max_len` tokens is enough.

    `prompt_buckets`: the lengths prompts are left-padded to (see `prompt_buckets`); by default every
    length from 1 to `max_len - 1` is its own bucket, so nothing is padded.

    `events` counts the batch operations run (insert, filter, shift_left, shift_right), so tests can
    check that a scenario exercised them; `shapes` logs the forward input shapes met.
    """

    def __init__(
        self,
        model: Any,
        layout: CacheLayout,
        rows: int,
        max_len: int,
        prompt_buckets: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.cache = StaticCache.allocate(layout, rows, max_len)
        self.prompt_buckets = sorted(prompt_buckets) if prompt_buckets else list(range(1, max_len))
        self.running: list[Row] = []
        self.events: Counter[str] = Counter()
        self.shapes = ShapeLog()  # keys: (input_ids shape, attention mask shape, cache width)
        self._warming_up = False

    @property
    def num_free_rows(self) -> int:
        return self.cache.rows - len(self.running)

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, list[KV]]:
        """Run a prompt alone (a batch of one), left-padded to its bucket: the logits of its own
        positions `[len(prompt), vocab]` and their KV, as if it had run unpadded.

        The padding is masked out and its positions sit left of position 0 (all given 0), so the real
        tokens keep positions 0..n-1; its KV is dropped here, so it never reaches the cache.
        """
        width = bucket_for(self.prompt_buckets, len(prompt), "a prompt")
        pad = width - len(prompt)
        device = self.cache.mask.device
        input_ids = torch.tensor([[0] * pad + list(prompt)], device=device)
        columns = torch.arange(width, device=device)[None]
        attention_mask = (columns >= pad).long()
        positions = (columns - pad).clamp(min=0)
        logits, kv = self._forward(input_ids, attention_mask, positions, [])
        return logits[0, pad:], [(keys[:, :, pad:], values[:, :, pad:]) for keys, values in kv]

    def insert(self, row: Row, kv: list[KV], length: int) -> None:
        """Put a prefilled sequence of `length` positions into the first free row, widening the batch
        first if it is longer than the used width."""
        if not self.num_free_rows:
            raise ValueError(f"no free row: all {self.cache.rows} are occupied")
        if length > self.cache.end:
            self.cache.shift_right(length - self.cache.end)
            self.events["shift_right"] += 1
        self.cache.insert(len(self.running), self.cache.layout.from_kv(kv), length)
        self.running.append(row)
        self.events["insert"] += 1

    def decode(self, last_tokens: Sequence[int]) -> torch.Tensor:
        """Feed each occupied row its last token (in `running` order); their next-token logits `[n, vocab]`.

        Shifts left first when the used width has reached `max_len`.
        """
        cache = self.cache
        if len(last_tokens) != len(self.running):
            raise ValueError(f"{len(last_tokens)} tokens for {len(self.running)} occupied rows")
        if cache.end == cache.max_len:
            cache.shift_left(cache.leading_padding())  # at least 1: see the class docstring
            self.events["shift_left"] += 1
        tokens = list(last_tokens) + [0] * self.num_free_rows  # free rows compute garbage nobody reads
        logits, new_kv = self._forward(*self._decode_inputs(tokens))
        cache.append(new_kv)
        return logits[: len(self.running), -1]

    def _decode_inputs(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[KV]]:
        """A decode step's input_ids `[rows, 1]`, attention mask `[rows, max_len + 1]`, position ids
        and past: one token per row after the whole static width, not just the used columns, so that
        every decode step has one shape (as on a Gaudi, whose model writes its static cache in place).
        Reading the columns from `end` on changes nothing: the cache keeps their mask 0."""
        cache = self.cache
        input_ids = torch.tensor(tokens, device=cache.mask.device)[:, None]
        position_ids = cache.mask.sum(dim=1, keepdim=True)  # real positions before the new one
        attention_mask = torch.cat([cache.mask, cache.occupied().long()[:, None]], dim=1)
        return input_ids, attention_mask, position_ids, cache.layout.to_kv(cache.layers, cache.max_len)

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[KV],
    ) -> tuple[torch.Tensor, list[KV]]:
        """`forward_step`, logging its input shapes."""
        width = past[0][0].shape[2] if past else 0
        self.shapes.record((tuple(input_ids.shape), tuple(attention_mask.shape), width), self._warming_up)
        return forward_step(self.model, input_ids, attention_mask, position_ids, past)

    def warm_up(self) -> None:
        """Run every shape serving can meet once, so that on a Gaudi each is compiled before a user
        waits for it: a prefill per prompt bucket (largest first, to size the memory pools) and one
        decode step. Dummy inputs, outputs dropped: the cache is read, never written.
        """
        todo = [*sorted(self.prompt_buckets, reverse=True), None]  # None: the decode step
        start = time.perf_counter()
        self._warming_up = True
        try:
            for width in tqdm(todo, desc="warmup", unit="shape", disable=None):
                if width is not None:
                    self.prefill([0] * width)
                    continue
                input_ids, attention_mask, position_ids, past = self._decode_inputs([0] * self.cache.rows)
                attention_mask[:, -1] = 1  # each dummy row sees its own token: no fully masked row
                self._forward(input_ids, attention_mask, position_ids, past)
        finally:
            self._warming_up = False
        logger.info("static-batch warmup: %d shapes in %.1f s", len(todo), time.perf_counter() - start)

    def retire(self, done: Callable[[Row], bool]) -> list[Row]:
        """Filter out the rows whose occupant is `done`, compacting the rest; returns the retired."""
        keep = [index for index, row in enumerate(self.running) if not done(row)]
        if len(keep) == len(self.running):
            return []
        retired = [row for row in self.running if done(row)]
        self.cache.filter(keep)
        self.running = [self.running[index] for index in keep]
        self.events["filter"] += 1
        return retired


@dataclass
class GreedyRequest:
    """One prompt, its token budget, and the tokens generated so far."""

    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)

    def finished(self, eos_token_id: int | None) -> bool:
        return len(self.output) >= self.max_new_tokens or (
            eos_token_id is not None and bool(self.output) and self.output[-1] == eos_token_id
        )


class StaticBatchGenerator:
    """Greedy generation for many requests through one static cache of `rows` x `max_len` positions.

    Each round admits waiting requests into free rows, then decodes every occupied row once. `events`
    counts the batch operations run, as `StaticBatch.events`.
    """

    def __init__(
        self,
        model: Any,
        layout: CacheLayout,
        rows: int,
        max_len: int,
        eos_token_id: int | None = None,
        prompt_buckets: Sequence[int] | None = None,
    ) -> None:
        self.batch: StaticBatch[GreedyRequest] = StaticBatch(model, layout, rows, max_len, prompt_buckets)
        self.eos_token_id = eos_token_id

    @property
    def cache(self) -> StaticCache:
        return self.batch.cache

    @property
    def running(self) -> list[GreedyRequest]:
        return self.batch.running

    @property
    def events(self) -> Counter[str]:
        return self.batch.events

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], max_new_tokens: Sequence[int]) -> list[list[int]]:
        """Each prompt's greedy continuation, at most its `max_new_tokens` long, ending at EOS if met."""
        requests = [GreedyRequest(list(p), m) for p, m in zip(prompts, max_new_tokens, strict=True)]
        for request in requests:
            self._check_fits(request)
        waiting = deque(requests)
        while waiting or self.running:
            self._admit(waiting)
            if self.running:
                self._decode_step()
        return [request.output for request in requests]

    def _check_fits(self, request: GreedyRequest) -> None:
        """Refuse a request that could fill a row: with prompt + new <= max_len it never does."""
        if len(request.prompt) + request.max_new_tokens > self.cache.max_len:
            raise ValueError(
                f"a prompt of {len(request.prompt)} + {request.max_new_tokens} new tokens "
                f"exceeds max_len {self.cache.max_len}"
            )

    def _admit(self, waiting: deque[GreedyRequest]) -> None:
        """Prefill waiting requests alone, take their first tokens, insert them while rows are free."""
        while waiting and self.batch.num_free_rows:
            request = waiting.popleft()
            logits, kv = self.batch.prefill(request.prompt)
            request.output.append(int(logits[-1].argmax()))
            if not request.finished(self.eos_token_id):
                self.batch.insert(request, kv, len(request.prompt))

    def _decode_step(self) -> None:
        """Feed every row its last token, take the next ones, retire finished rows."""
        logits = self.batch.decode([request.output[-1] for request in self.running])
        for request, token in zip(self.running, logits.argmax(-1).tolist(), strict=True):
            request.output.append(token)
        self.batch.retire(lambda request: request.finished(self.eos_token_id))
