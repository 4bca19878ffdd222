"""A shared engine-vs-transformers scenario: staggered arrivals, chunked prefill, preemption, prefix hits.

One engine run serves requests of different prompt lengths that arrive at different steps and
finish at different steps. The token budget forces chunked prefill, the block pool forces
preemption, and two prompts share a long prefix so that the second hits the prefix cache.
Each request's greedy tokens must equal transformers `generate` run on that prompt alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams


@dataclass
class ScenarioRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int
    output: list[int] = field(default_factory=list)
    finish_step: int = -1


def build_requests(
    vocab_size: int, lengths: list[int], seed: int = 0, shared_prefix: int = 24
) -> list[ScenarioRequest]:
    """len(lengths) requests; the last one repeats the first prompt's first `shared_prefix` tokens."""
    rng = random.Random(seed)
    low = min(10, vocab_size // 4)  # skip the special tokens at the start of the vocabulary
    prompts = [[rng.randrange(low, vocab_size) for _ in range(n)] for n in lengths]
    prompts[-1][:shared_prefix] = prompts[0][:shared_prefix]
    requests = []
    for i, prompt in enumerate(prompts):
        max_new = 4 + (i * 7) % 17  # different lengths, so requests finish at different steps
        # The shared-prefix request arrives after the first one's prompt is cached.
        arrival = 3 + 2 * len(prompts) if i == len(prompts) - 1 else i // 2 * 2
        requests.append(ScenarioRequest(f"r{i}", prompt, max_new, arrival))
    return requests


def run_engine(engine: LLMEngine, requests: list[ScenarioRequest], max_steps: int = 5000) -> None:
    by_id = {r.request_id: r for r in requests}
    pending = sorted(requests, key=lambda r: r.arrival_step)
    step = 0
    while (pending or engine.has_unfinished_requests()) and step < max_steps:
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens, ignore_eos=True)
            engine.add_request(r.request_id, r.prompt, params)
        for out in engine.step():
            req = by_id[out.request_id]
            req.output.extend(out.new_token_ids)
            if out.finished:
                req.finish_step = step
        step += 1
    assert step < max_steps, "engine did not finish the scenario"


def reference_greedy(
    hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """transformers `generate`, greedy, on one prompt alone, stopping at `eos_token_id` if given."""
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id or 0,
        )
    return out[0, len(prompt) :].tolist()


def assert_scenario_parity(
    engine: LLMEngine, hf_model: torch.nn.Module, requests: list[ScenarioRequest]
) -> None:
    run_engine(engine, requests)
    stats = engine.stats()
    mismatches = []
    for r in requests:
        expected = reference_greedy(hf_model, r.prompt, r.max_new_tokens)
        if r.output != expected:
            mismatches.append(
                f"{r.request_id} (prompt {len(r.prompt)}): engine {r.output} != transformers {expected}"
            )
    assert not mismatches, "\n".join(mismatches)
    assert len({r.arrival_step for r in requests}) > 3, "requests must arrive at different steps"
    assert len({r.finish_step for r in requests}) > 3, "requests must finish at different steps"
    assert max(len(r.prompt) for r in requests) > engine.args.max_num_batched_tokens, "no chunked prefill"
    assert stats.num_preemptions >= 1, "the block pool was large enough to avoid preemption"
    assert stats.prefix_cache_hits > 0, "the shared prefix did not hit the prefix cache"
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
