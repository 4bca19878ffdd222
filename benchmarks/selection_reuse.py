"""How often selective decode picks again the blocks it picked at the steps before (issue 35: would a
device cache of hot host blocks save link reads?), with a real model: SmolLM2-135M-Instruct on a
~7K-token needle prompt (`tgserve.server.testing.needle`), greedy, selection on.

Every step's choice (per layer and KV head, the blocks besides the sink, the recent window and the
current one) is recorded; reported per placement and overall: the share of a step's chosen blocks
that the previous step chose too (a cache of the last step's picks), and that any of the last 4
steps chose (a cache up to 4x the budget), the sink and recent window left out of both counts.

    python benchmarks/selection_reuse.py [--budget 1024] [--placements 4] [--out docs/benchmarks]

With `--num-blocks N --kv-offload-gb G`, a pool smaller than the prompt: the context spills to
the host tier as it is prefilled, and the hot-block cache (`--hot-block-share`, of the pool's
bytes) serves the chosen host blocks it holds; its hit rate (chosen host blocks read from the
cache, every layer and head) is reported beside the reuse shares.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from tgserve.kernels import dispatch
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine import model_shard
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.needle import needle_prompt, placements


class ChoiceRecorder:
    """Wraps `dispatch.select_decode_blocks`: each call's choice, one call a layer, in layer order."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self._select = dispatch.select_decode_blocks

    def __enter__(self) -> ChoiceRecorder:
        def recording(*args, **kwargs):
            chosen = self._select(*args, **kwargs)
            self.record(chosen, args, kwargs)
            return chosen

        dispatch.select_decode_blocks = recording
        return self

    def record(self, chosen: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Keep one call's choice (`args`, `kwargs`: the call's, for a subclass that selects again)."""
        self.calls.append(chosen.cpu())

    def __exit__(self, *exc) -> None:
        dispatch.select_decode_blocks = self._select


def reuse(
    calls: list[torch.Tensor], num_layers: int, forced: Callable[[int], set[int]], window: int
) -> tuple[float, float]:
    """(share of picks the previous step made too, share any of the last `window` steps made);
    forced(step): the blocks that step reads whatever it chooses, left out."""
    history: dict[tuple[int, int], deque] = defaultdict(lambda: deque(maxlen=window))
    last_hits, window_hits, total = 0, 0, 0
    for index, chosen in enumerate(calls):
        layer, always = index % num_layers, forced(index // num_layers)
        for head in range(chosen.shape[1]):
            picks = set(chosen[0, head].tolist()) - always
            past = history[(layer, head)]
            if past:
                last_hits += len(picks & past[-1])
                window_hits += len(picks & set().union(*past))
                total += len(picks)
            past.append(picks)
    return last_hits / max(total, 1), window_hits / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--placements", type=int, default=4)
    parser.add_argument("--haystack-tokens", type=int, default=7000)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--model", help="a model directory or .gguf (default: the shipped SmolLM2 GGUF)")
    parser.add_argument(
        "--load-format", default="auto", help="dummy: random weights (the GPU benchmarks' kind)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-blocks", type=int, help="the KV pool's blocks (default: sized by the engine)")
    parser.add_argument("--kv-offload-gb", type=float, default=0.0, help="the host tier (0: off)")
    parser.add_argument(
        "--hot-block-share", type=float, help="the hot-block cache's share of the pool's bytes"
    )
    args = parser.parse_args()
    if args.hot_block_share is not None:  # a design parameter, not a flag: the engine's, replaced
        model_shard.HOT_BLOCK_SHARE = args.hot_block_share
    # No CUDA graphs: the recorder reads every choice back as it is made.
    engine = LLMEngine(
        EngineArgs(model=args.model or str(default_model_gguf()), device=args.device, dtype=args.dtype,
                   load_format=args.load_format, decode_attention_budget=args.budget,
                   decode_attention_min_context=1024, max_num_batched_tokens=2048, cuda_graphs=False,
                   num_blocks=args.num_blocks, kv_offload_gb=args.kv_offload_gb)
    )  # fmt: skip
    hot = None if engine.shard.host_pool is None else engine.shard.host_pool.hot_blocks
    selection, block = engine.shard.selection, engine.args.block_size
    num_layers = len([s for s in engine.shard.specs if s.summary_dtype is not None])
    sink, recent = selection.sink_blocks(block), selection.recent_blocks(block)
    rows = []
    for i, placement in enumerate(placements(args.placements)):
        prompt = needle_prompt(engine.tokenizer, placement, args.haystack_tokens)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        with ChoiceRecorder() as recorder:
            engine.add_request(f"p{i}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()

        def forced(step: int, length: int = len(prompt)) -> set[int]:
            """The sink's blocks and the recent window's (a block of margin): read every step, not
            a cache's business."""
            blocks = -(-(length + 1 + step) // block)
            return set(range(sink)) | set(range(blocks - recent - 1, blocks))

        last, window = reuse(recorder.calls, num_layers, forced, 4)
        hits, misses = (0, 0) if hot is None else hot.counts()
        rate = hits / max(1, hits + misses)  # since the start: over every placement so far
        rows.append((placement.depth, last, window, len(recorder.calls) // num_layers, rate))
        print(f"depth {placement.depth:.2f}: steps {rows[-1][3]}, previous step {last:.3f}, last 4 steps {window:.3f}"
              + ("" if hot is None else f", hot-block hits so far {hits} of {hits + misses} ({rate:.3f})"),
              flush=True)  # fmt: skip
    print("| budget | placements | picks the previous step made too | picks one of the last 4 steps made "
          "| chosen host blocks read from the hot-block cache |")  # fmt: skip
    print("|---|---|---|---|---|")
    print(f"| {args.budget} | {len(rows)} | {statistics.fmean(r[1] for r in rows):.3f} | "
          f"{statistics.fmean(r[2] for r in rows):.3f} | {'-' if hot is None else f'{rows[-1][4]:.3f}'} |")  # fmt: skip


if __name__ == "__main__":
    main()
