"""What a model with dummy weights generates: the GPU benchmarks' decode steps, token by token.

`load_format="dummy"` fills every weight uniformly in [-1e-3, 1e-3], norms included, so each layer
adds almost nothing to the residual stream: the logits are a function of the current token's
embedding, and greedy decoding falls into a cycle. What a step computes then repeats with the
cycle: a mixture of experts routes every step to the experts of the cycle's few tokens, and
selective decode's queries alternate between as many. Reported per prompt: distinct tokens
among those generated and the cycle the tail settles in, greedy and sampled (temperature 1), and
for a mixture of experts the distinct expert sets a layer chose over the one-token steps.

    python benchmarks/dummy_decode_cycles.py [--model DIR_OR_GGUF] [--prompts 4] [--new-tokens 64]
"""

from __future__ import annotations

import argparse

import torch

from tgserve.kernels import dispatch
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.models.gpt_oss import GptOssMoE
from tgserve.server.models.moe import SparseMoE
from tgserve.server.protocol.params import SamplingParams


def cycle_length(tokens: list[int], tail: int = 16) -> int | None:
    """The shortest period the last `tail` tokens repeat with, or None if they do not repeat."""
    end = tokens[-tail:]
    for period in range(1, tail // 2 + 1):
        if all(end[i] == end[i - period] for i in range(period, len(end))):
            return period
    return None


ROUTERS = ("route", "route_top_logits")  # Mixtral and Qwen's; gpt-oss's


class RouteRecorder:
    """Wraps the routers of `dispatch`: the expert sets of one-token calls, in call order."""

    def __init__(self) -> None:
        self.sets: list[frozenset[int]] = []
        self._routers = {name: getattr(dispatch, name) for name in ROUTERS}

    def __enter__(self) -> RouteRecorder:
        for name, router in self._routers.items():
            setattr(dispatch, name, self._recording(router))
        return self

    def _recording(self, router):
        def recording(logits, *args, **kwargs):
            weights, ids = router(logits, *args, **kwargs)
            if ids.shape[0] == 1:
                self.sets.append(frozenset(ids[0].tolist()))
            return weights, ids

        return recording

    def __exit__(self, *exc) -> None:
        for name, router in self._routers.items():
            setattr(dispatch, name, router)

    def distinct_per_layer(self, num_layers: int) -> tuple[float, float]:
        """Means over layers of the distinct expert sets a layer chose and of its one-token calls."""
        per_layer = [self.sets[layer::num_layers] for layer in range(num_layers)]
        return (
            sum(len(set(calls)) for calls in per_layer) / num_layers,
            sum(len(calls) for calls in per_layer) / num_layers,
        )


def generate(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, name: str
) -> tuple[list[int], str]:
    """The generated tokens, and the distinct expert sets a layer chose ("-" without experts)."""
    engine.add_request(name, prompt, params)
    tokens: list[int] = []
    with RouteRecorder() as routes:
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += output.new_token_ids
    layers = sum(1 for m in engine.shard.forward.model.modules() if isinstance(m, SparseMoE | GptOssMoE))
    if not routes.sets:
        return tokens, "-"
    distinct, calls = routes.distinct_per_layer(layers)
    return tokens, f"{distinct:.1f} of {calls:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a model directory or .gguf (default: the shipped SmolLM2 GGUF)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    engine = LLMEngine(
        EngineArgs(model=args.model or str(default_model_gguf()), device=args.device, dtype="float32",
                   load_format="dummy")
    )  # fmt: skip
    print("| prompt | decoding | distinct of generated | cycle at the end | expert sets a layer, of steps |")
    print("|---|---|---|---|---|")
    for seed in range(args.prompts):
        generator = torch.Generator().manual_seed(seed)
        prompt = torch.randint(100, engine.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
        for label, temperature in (("greedy", 0.0), ("sampled, temperature 1", 1.0)):
            params = SamplingParams(temperature=temperature, max_new_tokens=args.new_tokens, ignore_eos=True)
            tokens, experts = generate(engine, prompt, params, f"{seed}-{label}")
            period = cycle_length(tokens)
            print(f"| {seed} | {label} | {len(set(tokens))} of {len(tokens)} | "
                  f"{'none' if period is None else f'{period} tokens'} | {experts} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
