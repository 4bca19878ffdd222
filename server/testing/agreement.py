"""Greedy-step agreement between the engine and transformers on short chat prompts.

The measure behind the CUDA backend's bf16 acceptance (the engine's tokens against transformers' on
SmolLM2, 32 prompts), shared by its GPU test and `benchmarks/bf16_agreement.py`. The engine
generates greedily; transformers then predicts every one of those steps given the same prefix (the
engine's own tokens, teacher-forced), so one early near-tie does not count against every later step.
Two ways to ask transformers: one forward over the whole sequence a prompt (`whole_sequence_picks`),
or its own cached decode loop over the batch, left-padded and one token a step as `generate` runs
it (`decode_loop_picks`). Where they part, `gaps_in_ulps` says by how much: how far below
transformers' largest logit the engine's token lies, in steps of the logits' own rounding.
"""

from __future__ import annotations

import inspect

import torch

from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams

# How far below transformers' largest bf16 logit the engine's token may lie where they part, in the
# logits' rounding steps (0.125 at 16-32): transformers' own decode loop and whole-sequence forward
# part by up to 4; a wrong kernel parts by whole logit units, tens of steps.
GAP_LIMIT_ULPS = 8

TOPICS = [
    "the ocean",
    "photosynthesis",
    "the Roman empire",
    "jazz",
    "volcanoes",
    "prime numbers",
    "coffee",
    "the moon",
    "honeybees",
    "chess",
    "glaciers",
    "the printing press",
    "rainbows",
    "electric cars",
    "penguins",
    "the internet",
    "bread",
    "earthquakes",
    "Mozart",
    "deserts",
    "tea",
    "black holes",
    "bicycles",
    "the heart",
    "forests",
    "democracy",
    "comets",
    "cheese",
    "lighthouses",
    "gravity",
    "owls",
    "the Nile",
]


def chat_prompts(tokenizer, topics: list[str] = TOPICS) -> list[list[int]]:
    """One chat-templated request a topic: "Write a short paragraph about <topic>."."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Write a short paragraph about {topic}."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for topic in topics
    ]


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The engine's greedy continuations, all prompts submitted at once (batched as served)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", list(prompt), params)
    outputs: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[f"p{i}"] for i in range(len(prompts))]


@torch.no_grad()
def whole_sequence_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's logits [len(tokens), vocab] at each of `tokens`' positions, in the model's dtype,
    from one forward over prompt + tokens."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens)], device=device)
    return model(ids).logits[0, len(prompt) - 1 : -1]


def whole_sequence_picks(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[int]:
    """The model's argmax at each of `tokens`' positions, from one forward over prompt + tokens."""
    return whole_sequence_logits(model, prompt, tokens).argmax(-1).tolist()


def _largest_and_picked(logits: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step, in float32: the largest logit, and the logit of that step's token."""
    top = logits.float().max(-1).values
    picked = logits.float().gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    return top, picked


def logit_gaps(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """How far below each step's largest logit the logit of that step's token lies, in logit units
    (0 where it is the largest): the measure for caches and formats whose error is not the logits'
    rounding (an fp8 KV cache)."""
    top, picked = _largest_and_picked(logits, tokens)
    return (top - picked).tolist()


def gaps_in_ulps(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """How far below each step's largest logit the logit of that step's token lies, in units of the
    logits' own rounding step at the largest (for bf16 logits of 16-32, 0.125). 0 where the token
    ties the largest; a disagreement of 1-2 units is a near-tie that rounding alone can flip."""
    top, picked = _largest_and_picked(logits, tokens)
    tiny = torch.finfo(logits.dtype).tiny
    spacing = torch.finfo(logits.dtype).eps * torch.exp2(torch.floor(torch.log2(top.abs().clamp(min=tiny))))
    return ((top - picked) / spacing).tolist()


def summarise_gaps(logits: list[torch.Tensor], tokens: list[list[int]]) -> dict[str, float]:
    """Over every step of every sequence (`logits[i]` judging `tokens[i]`, as `gaps_in_ulps`): the
    steps whose token ties the largest logit, those within one rounding step of it, the largest gap."""
    gaps = [g for rows, picked in zip(logits, tokens, strict=True) for g in gaps_in_ulps(rows, picked)]
    return {
        "ties_largest": sum(g == 0 for g in gaps),
        "within_one_step": sum(g <= 1 for g in gaps),
        "largest_gap_steps": max(gaps, default=0.0),
    }


@torch.no_grad()
def decode_loop_picks(
    model: torch.nn.Module, prompts: list[list[int]], tokens: list[list[int]]
) -> list[list[int]]:
    """The model's argmax at every step of its own cached decode loop: the prompts left-padded into
    one batch, prefilled together, then one token a row a step, each row fed the engine's token."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
        mask[row, width - len(prompt) :] = 1
    fed = torch.tensor(tokens, device=device)  # [rows, steps]
    # transformers is renaming `past_key_values` to `cache` model by model.
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    picks, cache, step_ids = [], None, ids
    for step in range(fed.shape[1]):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{cache_argument: cache},
        )
        cache = out["cache"] if "cache" in out.keys() else out.past_key_values
        picks.append(out.logits[:, -1].argmax(-1))
        step_ids = fed[:, step : step + 1]
        mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
    return torch.stack(picks, dim=1).tolist()


def count_agreeing(picks: list[list[int]], tokens: list[list[int]]) -> int:
    return sum(
        a == b
        for row_picks, row in zip(picks, tokens, strict=True)
        for a, b in zip(row_picks, row, strict=True)
    )


def engine_forced_picks(
    engine: LLMEngine, prompts: list[list[int]], tokens: list[list[int]]
) -> list[list[int]]:
    """The engine's own argmax at each of `tokens`' steps given the same prefix (teacher-forced): each
    prompt and its tokens go in as one prompt, and the top-1 of its prompt log-probabilities at the
    tokens' positions is read back. Measures one engine (e.g. quantized) against another's tokens."""
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=1)
    for i, (prompt, row) in enumerate(zip(prompts, tokens, strict=True)):
        engine.add_request(f"forced{i}", list(prompt) + list(row), params)
    logprobs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                logprobs[out.request_id] = out.prompt_logprobs
    return [
        [logprobs[f"forced{i}"][len(prompt) + step].top[0][0] for step in range(len(row))]
        for i, (prompt, row) in enumerate(zip(prompts, tokens, strict=True))
    ]
