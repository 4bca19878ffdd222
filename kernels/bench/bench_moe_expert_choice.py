"""Does the one-token MoE layer's time depend on which experts each step picks? (GPU only)

A decode step reads k experts' weights of each layer: the same ones step after step in a
benchmark whose router always picks them, fresh ones in real traffic. If fresh picks cost more
(the GPU's address translation reaching past what it caches, say), a benchmark with fixed picks
would flatter the kernel. This replays a CUDA graph of `layers` one-token MoE layers
(`moe_decode.one_token_moe`, Qwen3-30B-A3B's shapes by default) with the expert ids rewritten
before each replay: the same ids every step, k random of all experts, k random of 16, and the
graph alone without the id copies. Prints microseconds a layer.

    python kernels/bench/bench_moe_expert_choice.py [--experts 128 --top-k 8 --hidden 2048 --inter 768]
"""

from __future__ import annotations

import argparse

import torch

from tgserve.kernels import moe_decode
from tgserve.kernels.moe_routing import route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    experts, k, layers, steps = args.experts, args.top_k, args.layers, args.steps
    torch.manual_seed(0)
    x = torch.randn(1, args.hidden, device="cuda", dtype=torch.bfloat16)
    weights = [
        (
            0.02 * torch.randn(experts, 2 * args.inter, args.hidden, device="cuda", dtype=torch.bfloat16),
            0.02 * torch.randn(experts, args.hidden, args.inter, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(layers)
    ]
    routing, first_ids = route(torch.randn(1, experts, device="cuda"), k, renormalize=True)
    ids = [first_ids.clone() for _ in range(layers)]

    def step() -> None:
        for layer in range(layers):
            moe_decode.one_token_moe(x, *weights[layer], routing, ids[layer])

    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def picks(pool: int) -> torch.Tensor:
        """[steps, layers, k] expert ids, k distinct of the first `pool` experts each time."""
        out = torch.empty(steps, layers, k, dtype=torch.int64)
        for s in range(steps):
            for layer in range(layers):
                out[s, layer] = torch.randperm(pool)[:k]
        return out.cuda()

    def us_a_layer(schedule: torch.Tensor | None) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):  # the first round warms up; the second is timed
            torch.cuda.synchronize()
            start.record()
            for s in range(steps):
                if schedule is not None:
                    for layer in range(layers):
                        ids[layer][0].copy_(schedule[s, layer])
                graph.replay()
            end.record()
            torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / steps / layers

    same = picks(experts)[:1].expand(steps, layers, k).contiguous()
    rows = [
        ("fixed experts, no id copies", None),
        ("fixed experts, with the id copies", same),
        (f"{k} random of {experts} each step", picks(experts)),
        (f"{k} random of 16 each step", picks(16)),
        (f"{k} random of {experts} each step, again", picks(experts)),
        ("fixed experts, no id copies, again", None),
    ]
    print("| expert ids | us a layer |\n|---|---|")
    for name, schedule in rows:
        print(f"| {name} | {us_a_layer(schedule):.2f} |")


if __name__ == "__main__":
    main()
