"""One sequence's forward steps as transformers' `generate` takes them, for models whose state the
engine keeps in transformers' own cache (`kept_states.py`): a first forward over the sequence's
tokens, then one token a step, with the model's own `prepare_inputs_for_generation` and
`_update_model_kwargs_for_generation` preparing each step's inputs and carrying the cache, so each
model gets the inputs its own generation loop gives it (Mamba's `cache_params`, RWKV's `state`,
hybrids' caches of several kinds).

transformers 5 takes a step's length as `next_sequence_length`; 4.x (the Gaudi image's) tracks
`cache_position` in the kwargs. A model whose one-token continuation does not reproduce its own
uncached forward (`continuation_error`) is recomputed instead.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The generation kwargs a kept state holds: the cache, the attention mask, and with 4.x the position.
GenerationKwargs = dict[str, Any]


@functools.cache
def _base_parameters() -> frozenset[str]:
    """The generation API's parameters, read once: a step asks on every decode row."""
    from transformers.generation.utils import GenerationMixin

    return frozenset(inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters)


def start_generation(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, GenerationKwargs]:
    """The last logits of a forward over ids [1, L] that builds the model's cache, and the kwargs
    that carry it to the next step."""
    parameters = _base_parameters()
    kwargs: GenerationKwargs = {"use_cache": True, "attention_mask": torch.ones_like(ids)}
    if "next_sequence_length" not in parameters:
        kwargs["cache_position"] = torch.arange(ids.shape[1], device=ids.device)
    first = {"is_first_iteration": True} if "is_first_iteration" in parameters else {}
    return _step(model, ids, kwargs, first)


def continue_generation(
    model: nn.Module, ids: torch.Tensor, kwargs: GenerationKwargs
) -> tuple[torch.Tensor, GenerationKwargs]:
    """The last logits of ids [1, L], whose first L - 1 tokens built the cache in `kwargs` (which
    this continues in place), and the kwargs for the step after."""
    one_token = {"next_sequence_length": 1} if "next_sequence_length" in _base_parameters() else {}
    return _step(model, ids, kwargs, one_token)


def _step(
    model: nn.Module, ids: torch.Tensor, kwargs: GenerationKwargs, extra: dict[str, Any]
) -> tuple[torch.Tensor, GenerationKwargs]:
    inputs = model.prepare_inputs_for_generation(ids, **extra, **kwargs)
    outputs = model(**inputs, return_dict=True)
    kwargs = model._update_model_kwargs_for_generation(outputs, kwargs, is_encoder_decoder=False)
    return outputs.logits[0, -1], kwargs


@torch.no_grad()
def continuation_error(
    model: nn.Module, uncached: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> float:
    """How far one-token steps over a kept cache land from the uncached forward (`uncached`, ids [L]
    to the last logits), relative to the logits' size: random tokens, a first forward over 8 of
    them, then 4 steps. Exact continuation gives rounding only (about 1e-6 in float32)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=generator).to(device)
    got, kwargs = start_generation(model, ids[:, :8])
    steps = [got]
    for length in range(9, 13):
        got, kwargs = continue_generation(model, ids[:, :length], kwargs)
        steps.append(got)
    want = [uncached(ids[0, :length]) for length in range(8, 13)]
    gap = max(float((a.float() - b.float()).abs().max()) for a, b in zip(steps, want, strict=True))
    return gap / max(float(w.float().abs().max()) for w in want)
