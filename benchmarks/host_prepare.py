"""Host time to build a step's inputs (token ids, positions, cache slots) before its first kernel.

    python benchmarks/host_prepare.py

Times `ModelRunner._prepare_inputs` on the CPU for (c)'s shape, one 130,944-token prompt, and for a
(b)-shaped prefill step, 32 prompts of 500 tokens; the forward is skipped (the llama fixture, its
context raised for the long prompt). Baseline in the same run: the same three columns built token
by token in Python lists, as the runner built them before. Median of --repeats. Then the whole
host path of (c)'s request (add_request, then the steps to its one token), forward skipped.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.fixtures import fixture_path


def token_by_token(requests: list[tuple[list[int], list[int]]], block_size: int) -> list[torch.Tensor]:
    """The baseline: (token ids, block ids) of whole-prompt spans, one Python int at a time."""
    ids, positions, slots = [], [], []
    for token_ids, block_ids in requests:
        ids.extend(token_ids)
        positions.extend(range(len(token_ids)))
        slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(len(token_ids)))
    return [torch.tensor(column, dtype=torch.int64) for column in (ids, positions, slots)]


def forwardless_engine(tokens: int, max_prompt: int, **engine_args) -> LLMEngine:
    """The llama fixture on the CPU for steps of up to `tokens` tokens and prompts of up to
    `max_prompt`, its forward skipped (zero logits): only host work is left to time."""
    engine = LLMEngine(EngineArgs(model=str(fixture_path("llama")), device="cpu", max_num_batched_tokens=tokens,
                                  num_blocks=tokens // 16 + 64, **engine_args))  # fmt: skip
    engine.max_model_len = engine.scheduler._max_len = max_prompt + 16  # the fixture allows 512
    engine.runner.executor.run = lambda inputs: torch.zeros(inputs.logits_indices.shape[0], engine.vocab_size)
    return engine


def measure(prompt_lens: list[int], repeats: int) -> tuple[float, float]:
    """(runner ms, token-by-token ms): medians for one prefill step of these prompts."""
    engine = forwardless_engine(sum(prompt_lens), max(prompt_lens))
    runner, runner_s, baseline_s = engine.runner, [], []
    prepare = runner._prepare_inputs

    def timed(out):  # the step's inputs, built `repeats` times from the same request states
        spans = [(state.token_ids, state.block_ids) for state in runner.requests.values()]
        for _ in range(repeats):
            start = time.perf_counter()
            inputs = prepare(out)
            runner_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            token_by_token(spans, runner.block_size)
            baseline_s.append(time.perf_counter() - start)
        return inputs

    runner._prepare_inputs = timed
    for i, n in enumerate(prompt_lens):
        engine.add_request(f"p{i}", [5 + (i + j) % 500 for j in range(n)],
                           SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))  # fmt: skip
    engine.step()
    return statistics.median(runner_s) * 1e3, statistics.median(baseline_s) * 1e3


def whole_request(prompt_len: int, repeats: int) -> tuple[float, float]:
    """(add_request ms, steps ms): medians of one prompt of prompt_len tokens and one new token
    through the engine, forward skipped: validation, scheduling, block allocation, inputs,
    sampling and freeing, all host work on (c)'s time to first token."""
    engine = forwardless_engine(prompt_len, prompt_len, enable_prefix_caching=False)
    prompt = [5 + j % 500 for j in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    add_s, steps_s = [], []
    for i in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        engine.add_request(f"w{i}", prompt, params)
        added = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        add_s.append(added - start)
        steps_s.append(time.perf_counter() - added)
    return statistics.median(add_s[1:]) * 1e3, statistics.median(steps_s[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| step | runner ms | token by token ms (baseline) |\n|---|---|---|")
    for name, lens in (("one 130,944-token prompt", [130944]), ("32 prompts of 500 tokens", [500] * 32)):
        runner_ms, baseline_ms = measure(lens, args.repeats)
        print(f"| {name} | {runner_ms:.1f} | {baseline_ms:.1f} |", flush=True)
    add_ms, steps_ms = whole_request(130944, args.repeats)
    print(f"\nOne 130,944-token prompt, one new token, forward skipped: add_request {add_ms:.1f} ms, "
          f"steps {steps_ms:.1f} ms, total {add_ms + steps_ms:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
