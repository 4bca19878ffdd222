"""Can a decode step know layer l + 1's block choice while layer l still runs? (issue 35: host blocks
fetched ahead of the layer that reads them, the link's time hidden behind compute.)

Selective decode picks each layer's blocks from that layer's query, so a host block is read over
the link while the step waits. The residual stream changes little from one layer to the next: the
query layer l + 1 would compute from the stream as it stands at layer l (its input norm, its
query projection and rotary) may pick nearly the same blocks. Per decode step and layer, the
choice from two such speculative queries is set beside the real choice:

- "layer input": the stream entering layer l (lead time: all of layer l),
- "after attention": the stream after layer l's attention is added (lead time: layer l's MLP),

and beside the previous step's choice of the same layer (what the hot-block cache keeps). Shares
count the chosen blocks besides the sink, the recent window and the current block, every layer but
the first (which has no layer before it) and every KV head.

    python benchmarks/selection_speculation.py [--budget 1024] [--placements 2] [--load-format dummy]

SmolLM2-135M-Instruct by default (the shipped GGUF) on a ~7K-token needle prompt, greedy, CPU,
float32; `--load-format dummy` gives the same architecture random weights, as the GPU benchmarks
run.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from selection_reuse import ChoiceRecorder  # this script's folder is on sys.path when run as a script

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.needle import needle_prompt, placements

POINTS = ("layer input", "after attention")


class StreamTaps:
    """Forward pre-hooks that keep, at each decode step, every layer's residual stream at its input
    and after its attention (the deferred adds done), with the step's positions."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.streams: dict[tuple[str, int], torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self._handles = []
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._at_input(index)))
            self._handles.append(
                layer.post_attention_layernorm.register_forward_pre_hook(self._after_attention(index))
            )

    def _at_input(self, index: int) -> Callable:
        def hook(module, args):
            positions, hidden, residual = args[0], args[1], args[2] if len(args) > 2 else None
            self.positions = positions
            self.streams[("layer input", index)] = hidden if residual is None else hidden + residual

        return hook

    def _after_attention(self, index: int) -> Callable:
        def hook(module, args):
            hidden, residual = args
            self.streams[("after attention", index)] = hidden + residual

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def speculative_query(layer: torch.nn.Module, stream: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rotated queries `layer` would compute from `stream` (its input norm, projection, rotary)."""
    with torch.no_grad():
        q, _, _ = layer.self_attn._qkv(positions, layer.input_layernorm(stream))
    return q


class SpeculatingRecorder(ChoiceRecorder):
    """ChoiceRecorder that also chooses, at each layer past the first, from the speculative queries
    of the stream taps (same summaries, tables and budget), kept in `speculated[point]`."""

    def __init__(self, layers: torch.nn.ModuleList, taps: StreamTaps) -> None:
        super().__init__()
        self.layers, self.taps = layers, taps
        self.speculated: dict[str, list[torch.Tensor | None]] = {point: [] for point in POINTS}

    def record(self, chosen: torch.Tensor, args: tuple, kwargs: dict) -> None:
        layer = len(self.calls) % len(self.layers)
        super().record(chosen, args, kwargs)
        query, rest = args[0], args[1:]
        for point in POINTS:
            stream = self.taps.streams.get((point, layer - 1)) if layer > 0 else None
            if stream is None or stream.shape[0] != query.shape[0]:
                self.speculated[point].append(None)
                continue
            guess = speculative_query(self.layers[layer], stream, self.taps.positions)
            self.speculated[point].append(self._select(guess, *rest, **kwargs).cpu())


def shares(
    recorder: SpeculatingRecorder, num_layers: int, forced: Callable[[int], set[int]]
) -> dict[str, float]:
    """Share of the real picks (forced blocks left out) that each speculative choice made too, and
    that the previous step's choice of the same layer made, over layers past the first."""
    hits = dict.fromkeys((*POINTS, "previous step", "previous step or after attention"), 0)
    total = 0
    for index, chosen in enumerate(recorder.calls):
        layer, step = index % num_layers, index // num_layers
        before = index - num_layers
        if layer == 0 or before < 0 or any(recorder.speculated[p][index] is None for p in POINTS):
            continue
        always = forced(step)
        for head in range(chosen.shape[1]):
            picks = set(chosen[0, head].tolist()) - always
            previous = set(recorder.calls[before][0, head].tolist())
            after = set(recorder.speculated["after attention"][index][0, head].tolist())
            for point in POINTS:
                hits[point] += len(picks & set(recorder.speculated[point][index][0, head].tolist()))
            hits["previous step"] += len(picks & previous)
            hits["previous step or after attention"] += len(picks & (previous | after))
            total += len(picks)
    return {name: count / max(total, 1) for name, count in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--placements", type=int, default=2)
    parser.add_argument("--haystack-tokens", type=int, default=7000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model", help="a model directory or .gguf (default: the shipped SmolLM2 GGUF)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights")
    args = parser.parse_args()
    engine = LLMEngine(
        EngineArgs(model=args.model or str(default_model_gguf()), device="cpu", dtype="float32",
                   load_format=args.load_format, decode_attention_budget=args.budget,
                   decode_attention_min_context=1024, max_num_batched_tokens=2048, cuda_graphs=False)
    )  # fmt: skip
    layers = engine.shard.forward.model.model.layers
    selection, block = engine.shard.selection, engine.args.block_size
    sink, recent = selection.sink_blocks(block), selection.recent_blocks(block)
    rows = []
    for i, placement in enumerate(placements(args.placements)):
        prompt = needle_prompt(engine.tokenizer, placement, args.haystack_tokens)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        taps = StreamTaps(layers)
        with SpeculatingRecorder(layers, taps) as recorder:
            engine.add_request(f"p{i}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
        taps.close()

        def forced(step: int, length: int = len(prompt)) -> set[int]:
            blocks = -(-(length + 1 + step) // block)
            return set(range(sink)) | set(range(blocks - recent - 1, blocks))

        rows.append(shares(recorder, len(layers), forced))
        print(
            f"depth {placement.depth:.2f}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1].items()),
            flush=True,
        )
    names = list(rows[0])
    print("| weights | budget | placements | " + " | ".join(names) + " |")
    print("|---" * (3 + len(names)) + "|")
    means = " | ".join(f"{statistics.fmean(r[name] for r in rows):.3f}" for name in names)
    print(f"| {args.load_format} | {args.budget} | {len(rows)} | {means} |")


if __name__ == "__main__":
    main()
