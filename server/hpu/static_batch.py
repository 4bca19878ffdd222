"""Static-batch greedy decoding through a `StaticCache`, the way tgi-gaudi drives optimum-habana models.

Requests are prefilled one at a time and inserted into free rows (shifting the batch right when a
prompt is longer than the used width), every decode step feeds one token per row with the attention
mask and per-row position ids, finished rows are filtered out, and when the static length is used up
the batch shifts left by its common leading padding. The loop never touches a layout's tensors: all it
knows is `StaticCache` and the layout's standard views.

On CPU this drives any transformers causal LM through any layout; the tests run the tiny GPT-BigCode
model through the fused multi-query layout against transformers `generate`. On a Gaudi, optimum-habana's
own classes take the layout's tensors directly; only `forward_step` would differ.
"""

from __future__ import annotations

import inspect
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache_layouts import KV, CacheLayout
from .static_cache import StaticCache


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


def forward_step(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    past: list[KV],
) -> tuple[torch.Tensor, list[KV]]:
    """Run `model` on `input_ids` after `past`; return the last position's logits and the new keys/values.

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
    return output.logits[:, -1], new_kv


def _cache_argument(model: Any) -> str:
    """The name `forward` takes the cache under.

    transformers 5.x renamed `past_key_values` to `cache` (the old name still works, with a warning,
    until 5.40); 4.55 knows only `past_key_values`.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StaticBatchGenerator:
    """Greedy generation for many requests through one static cache of `rows` x `max_len` positions.

    `events` counts the batch operations run (insert, filter, shift_left, shift_right), so tests can
    check that a scenario exercised them.
    """

    def __init__(
        self, model: Any, layout: CacheLayout, rows: int, max_len: int, eos_token_id: int | None = None
    ) -> None:
        self.model = model
        self.cache = StaticCache.allocate(layout, rows, max_len)
        self.eos_token_id = eos_token_id
        self.running: list[GreedyRequest] = []  # running[i] occupies row i: filter keeps them a prefix
        self.events: Counter[str] = Counter()

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
        """Refuse a request that could fill a row: a step needs a padding column to shift out.

        The last generated token is never fed back, so a request holds at most prompt + new - 1
        positions; with prompt + new <= max_len every row keeps a leading padding column when the
        used width reaches max_len, and `shift_left` always frees at least one column.
        """
        if len(request.prompt) + request.max_new_tokens > self.cache.max_len:
            raise ValueError(
                f"a prompt of {len(request.prompt)} + {request.max_new_tokens} new tokens "
                f"exceeds max_len {self.cache.max_len}"
            )

    def _admit(self, waiting: deque[GreedyRequest]) -> None:
        """Prefill waiting requests alone and insert them into free rows while rows are free."""
        while waiting and len(self.running) < self.cache.rows:
            request = waiting.popleft()
            kv = self._prefill(request)
            if not request.finished(self.eos_token_id):
                self._insert(request, kv)

    def _prefill(self, request: GreedyRequest) -> list[KV]:
        """Run the prompt alone (a batch of one, no padding); take its first token; return its KV."""
        input_ids = torch.tensor([request.prompt], device=self.cache.mask.device)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        logits, kv = forward_step(self.model, input_ids, torch.ones_like(input_ids), positions, [])
        request.output.append(int(logits.argmax(-1)))
        return kv

    def _insert(self, request: GreedyRequest, kv: list[KV]) -> None:
        """Put a prefilled request into the first free row, widening the batch first if it is longer."""
        length = len(request.prompt)
        if length > self.cache.end:
            self.cache.shift_right(length - self.cache.end)
            self.events["shift_right"] += 1
        self.cache.insert(len(self.running), self.cache.layout.from_kv(kv), length)
        self.running.append(request)
        self.events["insert"] += 1

    def _decode_step(self) -> None:
        """Feed every row its last token, append the new positions, retire finished rows."""
        cache = self.cache
        if cache.end == cache.max_len:
            cache.shift_left(cache.leading_padding())  # at least 1: see _check_fits
            self.events["shift_left"] += 1
        last = [request.output[-1] for request in self.running]
        tokens = last + [0] * (cache.rows - len(last))  # free rows compute garbage nobody reads
        input_ids = torch.tensor(tokens, device=cache.mask.device)[:, None]
        seen = cache.mask[:, : cache.end]
        position_ids = seen.sum(dim=1, keepdim=True)  # real positions before the new one
        attention_mask = torch.cat([seen, cache.occupied().long()[:, None]], dim=1)
        logits, new_kv = forward_step(
            self.model, input_ids, attention_mask, position_ids, cache.layout.to_kv(cache.layers, cache.end)
        )
        cache.append(new_kv)
        for request, token in zip(self.running, logits.argmax(-1).tolist()):
            request.output.append(token)
        keep = [row for row, request in enumerate(self.running) if not request.finished(self.eos_token_id)]
        if len(keep) < len(self.running):
            cache.filter(keep)
            self.running = [self.running[row] for row in keep]
            self.events["filter"] += 1
