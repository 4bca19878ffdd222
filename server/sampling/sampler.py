"""Turns a step's last-position logits into next tokens, one row per request.

Guided rows first lose every token their grammar disallows (`guided.TokenMask`: -inf). Then the
order of operations is transformers' `generate`: logit bias, repetition penalty, then (OpenAI's)
frequency and presence penalties; greedy rows take the argmax there. Sampling rows go on through
temperature, top-k, top-p, min-p and typical-p (transformers' warper order, min-p before typical-p)
and draw with an exponential race, argmax(p / E) with E ~ Exp(1), which picks token i with
probability p_i and lets each seeded row take its noise from its own generator.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tgserve.kernels import dispatch
from tgserve.server.device.transfer import pinned_to, to_device
from tgserve.server.protocol.outputs import TokenLogprob
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.sampling.guided import TokenMask, apply_token_mask

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One request's view for this step.

    `output_token_ids` is the output before this step's token; `step` is its length, so a recomputed
    (preempted) request draws the same randomness again. Only penalties read the token lists: the
    runner leaves them empty for requests without penalties.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    step: int


@dataclass
class LogprobTensors:
    """Log-probabilities of chosen tokens and their top alternatives, still as tensors: on the
    device until a step's output is collected, so computing them never makes the host wait."""

    chosen_ids: torch.Tensor  # [n] int64
    chosen: torch.Tensor  # [n] float32
    top_ids: torch.Tensor  # [n, max top_n] int64
    top_values: torch.Tensor  # [n, max top_n] float32
    top_n: list[int]  # alternatives wanted per row

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen_ids, self.chosen, self.top_ids, self.top_values]

    def replace_tensors(self, tensors: list[torch.Tensor]) -> LogprobTensors:
        """The same rows over other copies of the tensors (e.g. host copies of `tensors()`)."""
        return LogprobTensors(*tensors, self.top_n)

    def to_list(self) -> list[TokenLogprob]:
        chosen_ids, chosen = self.chosen_ids.tolist(), self.chosen.tolist()
        top_ids, top_values = self.top_ids.tolist(), self.top_values.tolist()
        return [
            TokenLogprob(
                token_id=chosen_ids[j],
                logprob=chosen[j],
                top=list(zip(top_ids[j][:k], top_values[j][:k], strict=True)),
            )
            for j, k in enumerate(self.top_n)
        ]


@dataclass
class SamplerOutput:
    """The chosen token per row ([B] int64, on the logits' device) and, for the rows
    `logprob_rows` that asked, their log-probabilities."""

    token_ids: torch.Tensor
    logprob_rows: list[int]
    logprob_tensors: LogprobTensors | None

    @property
    def logprobs(self) -> list[TokenLogprob | None]:
        """Per row, its logprobs or None; reads them on the host (waits for the device)."""
        out: list[TokenLogprob | None] = [None] * self.token_ids.shape[0]
        if self.logprob_tensors is not None:
            for i, logprob in zip(self.logprob_rows, self.logprob_tensors.to_list(), strict=True):
                out[i] = logprob
        return out


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed for (seed, step); explicit so it never depends on Python's hash()."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


# --- logits processors: each returns new logits (float32) for the rows it is given ----------------


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Adds each row's OpenAI-style logit_bias; ids outside the logits' vocabulary are ignored."""
    vocab = logits.shape[-1]
    entries = [
        (i, tok, bias)
        for i, r in enumerate(rows)
        for tok, bias in r.params.logit_bias.items()
        if 0 <= tok < vocab
    ]
    if not entries:
        return logits
    row_idx, tok_idx, bias = zip(*entries, strict=True)
    index = (to_device(row_idx, torch.int64, logits.device), to_device(tok_idx, torch.int64, logits.device))
    values = to_device(bias, logits.dtype, logits.device)
    return logits.index_put(index, values, accumulate=True)


def _param(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """[B, 1] per-row parameters in the logits' dtype, converted from Python floats as transformers' scalars are."""
    return to_device(values, like.dtype, like.device)[:, None]


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] float32 occurrence counts, built without a host sync."""
    lengths = [len(t) for t in token_lists]
    # np.fromiter is ~5x faster than torch.tensor(list) on the long prompt lists penalties need.
    ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    flat = pinned_to(torch.from_numpy(ids), device)
    row_idx = torch.repeat_interleave(
        torch.arange(len(token_lists), device=device),
        to_device(lengths, torch.int64, device),
        output_size=len(ids),
    )
    # Ids past the lm_head (padded embedding tables) land in a spare column that is dropped, as in transformers.
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    counts.index_put_(
        (row_idx, flat.clamp(max=vocab)), torch.ones_like(flat, dtype=torch.float32), accumulate=True
    )
    return counts[:, :vocab]


# The largest score kept: divided by any sampling temperature (>= GREEDY_BELOW_TEMPERATURE) it stays
# below float32's maximum, so softmax never sees inf - inf.
_MAX_SCORE = 1e33


def finite_scores(logits: torch.Tensor) -> torch.Tensor:
    """Scores every later step can compute with, in place: a repetition penalty near 0 (float32 0)
    turns a seen token's positive logit into +inf (kept as the largest score) and a disallowed
    token's -inf into nan (back to -inf). Without this a whole row's softmax is nan and argmax
    picks token 0, whatever the grammar or the model says."""
    return logits.nan_to_num_(nan=_NEG_INF, posinf=_MAX_SCORE, neginf=_NEG_INF).clamp_(max=_MAX_SCORE)


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """HF semantics over prompt + output: a seen token's logit is divided by the penalty if positive,
    multiplied if negative."""
    penalties = [r.params.repetition_penalty for r in rows]
    if all(p == 1.0 for p in penalties):
        return logits
    tokens = [
        r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows
    ]
    seen = _token_counts(tokens, logits.shape[-1], logits.device) > 0
    penalty = _param(penalties, logits)
    return finite_scores(
        torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    )


def apply_frequency_presence(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """OpenAI semantics over the output only: logit -= frequency * count + presence * (count > 0)."""
    active = [r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows]
    if not any(active):
        return logits
    tokens = [r.output_token_ids if on else [] for r, on in zip(rows, active, strict=True)]
    counts = _token_counts(tokens, logits.shape[-1], logits.device)
    frequency = _param([r.params.frequency_penalty for r in rows], logits)
    presence = _param([r.params.presence_penalty for r in rows], logits)
    return logits - (frequency * counts + presence * (counts > 0).float())


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty (transformers' position in the chain) then frequency/presence penalties."""
    return apply_frequency_presence(apply_repetition_penalty(logits, rows), rows)


# --- warpers: transformers' semantics, min_tokens_to_keep=1, one parameter per row -----------------
# Parameters become float32 tensors from Python floats exactly as transformers' scalar operands do,
# so threshold comparisons agree bit for bit.


def temperature_warp(logits: torch.Tensor, temperature: Sequence[float]) -> torch.Tensor:
    """Divides each row by its temperature (>= GREEDY_BELOW_TEMPERATURE: greedy rows never reach
    the warpers). One past float32's range (TGI sets no maximum) counts as _MAX_SCORE: every finite
    score becomes ~0 and -inf stays -inf, where inf would make -inf / inf nan."""
    return logits / _param(temperature, logits).clamp_(max=_MAX_SCORE)


def top_k_filter(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Masks tokens below each row's k-th largest logit (ties with it are kept)."""
    vocab = logits.shape[-1]
    k = [min(v, vocab) for v in top_k]
    top = torch.topk(logits, max(k), dim=-1).values
    kth = top.gather(1, to_device(k, torch.int64, logits.device)[:, None] - 1)
    return logits.masked_fill(logits < kth, _NEG_INF)


def top_p_filter(logits: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= _param([1.0 - p for p in top_p], logits)
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), _NEG_INF)


def min_p_filter(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    remove = probs < _param(min_p, logits) * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(1, torch.topk(probs, 1, dim=-1).indices, False)
    return logits.masked_fill(remove, _NEG_INF)


def typical_p_filter(logits: torch.Tensor, typical_p: Sequence[float]) -> torch.Tensor:
    """Keeps the tokens whose surprisal is closest to the entropy, up to typical_p of the mass."""
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)
    sorted_scores, sorted_idx = torch.sort((-log_probs - entropy).abs(), descending=False)
    cumulative = logits.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < _param(typical_p, logits)).sum(dim=1).clamp_(max=logits.shape[-1] - 1)
    remove = sorted_scores > sorted_scores.gather(1, last[:, None])
    remove[:, 0] = False
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), _NEG_INF)


Warper = Callable[[torch.Tensor, Sequence[Any]], torch.Tensor]

# (warper, parameter getter, the value that disables it), in transformers' order.
_WARPERS: tuple[tuple[Warper, Callable[[SamplingParams], float], float], ...] = (
    (temperature_warp, lambda p: p.temperature, 1.0),
    (top_k_filter, lambda p: p.top_k, 0),
    (top_p_filter, lambda p: p.top_p, 1.0),
    (min_p_filter, lambda p: p.min_p, 0.0),
    (typical_p_filter, lambda p: p.typical_p, 1.0),
)


def warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Applies every warper to the rows that enable it; other rows stay bit-identical."""
    for fn, get, disabled in _WARPERS:
        values = [get(p) for p in params]
        active = [i for i, v in enumerate(values) if v != disabled]
        if not active:
            continue
        if len(active) == len(values):
            logits = fn(logits, values)
        else:
            index = to_device(active, torch.int64, logits.device)
            logits = logits.index_copy(0, index, fn(logits[index], [values[i] for i in active]))
    return logits


# --- the sampler ------------------------------------------------------------------------------------


def _only_argmax(params: SamplingParams) -> bool:
    return params.greedy and params.logprobs is None and not params.logit_bias and not params.needs_penalties


class Sampler:
    """Picks one token per row. Stateless apart from a reusable generator per device."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None
    ) -> SamplerOutput:
        """logits: [B, V], any float dtype; rows: B rows in the same order; mask: the allowed
        tokens of the guided rows (log-probabilities stay those of the unmasked logits)."""
        if mask is None and all(_only_argmax(r.params) for r in rows):
            return SamplerOutput(dispatch.argmax(logits), [], None)
        # A copy, because .float() of float32 logits would alias (and let us mutate) the caller's tensor.
        x = logits.to(torch.float32, copy=True)
        if mask is not None:
            x = apply_token_mask(x, mask)
        x = apply_penalties(apply_logit_bias(x, rows), rows)
        token_ids = dispatch.argmax(x)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(sampled) == len(rows):
            token_ids = self._sample(x, rows)
        elif sampled:
            index = to_device(sampled, torch.int64, x.device)
            token_ids[index] = self._sample(x[index], [rows[i] for i in sampled])
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        return SamplerOutput(token_ids, wanted, compute_logprobs(logits, token_ids, rows, wanted))

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Exponential race over the warped distribution; seeded rows use noise from (seed, step) alone."""
        probs = warp(logits, [r.params for r in rows]).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                noise[i].exponential_(generator=self._seeded(probs.device, row.params.seed, row.step))
        # A zero draw would turn p/E into inf, or nan for p = 0, which argmax would pick.
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _seeded(self, device: torch.device, seed: int, step: int) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(row_seed(seed, step))


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow], wanted: list[int]
) -> LogprobTensors | None:
    """The model's own log-probabilities (raw logits) of rows `wanted`: the chosen token's and the top n."""
    if not wanted:
        return None
    index = to_device(wanted, torch.int64, logits.device)
    return logprob_tensors(logits[index], token_ids[index], [rows[i].params.logprobs or 0 for i in wanted])


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, top_n: Sequence[int]) -> LogprobTensors:
    """Per row of logits: the log-probability of token_ids[row] and the row's top_n[row] best alternatives."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(1, token_ids[:, None]).squeeze(1)
    n = min(max(top_n, default=0), logits.shape[-1])
    top_values, top_ids = torch.topk(log_probs, n, dim=-1) if n else (log_probs[:, :0], log_probs[:, :0])
    return LogprobTensors(token_ids, chosen, top_ids.long(), top_values, list(top_n))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: Sequence[int]) -> list[TokenLogprob]:
    """`logprob_tensors`, read on the host."""
    return logprob_tensors(logits, token_ids, top_n).to_list()
