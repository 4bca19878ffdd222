"""The grouped MoE kernels at batch-1 decode: tiles swept, time and bandwidth against the bytes of
the chosen experts, in CUDA graphs (kernels/moe.py's DECODE_LAUNCH is set from this table).

    python kernels/bench/bench_moe.py
    python kernels/bench/bench_moe.py --one-token   # the GEMV path (moe_decode.py) beside the grouped kernels
    python kernels/bench/bench_moe.py --one-token --each-kernel   # its two launches' settings swept apart

One token routed to k experts of each family's real shape, bf16; each graph runs the layer over
enough copies of the experts to exceed L2, as a decode step reads them from HBM. Every setting is
checked against the default's output first. The grouped kernels are timed with moe.ONE_TOKEN_GEMV
off (with it on, `fused_moe_triton` hands a one-token step to the GEMV path).
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_gemv import graph_us  # this script's folder is on sys.path when run as a script

from tgserve.kernels import moe, moe_decode
from tgserve.kernels.moe_routing import route

FAMILIES = {  # name: (experts, top k, hidden, intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
SWEEP = [
    dict(block_n=n, block_k=k, num_warps=w, num_stages=s)
    for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4))
]


def layers(experts: int, top_k: int, hidden: int, inter: int, copies: int):
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = route(torch.randn(1, experts, device="cuda"), top_k, renormalize=True)
    w = [(0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16),
          0.02 * torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]  # fmt: skip
    return x, weights, ids, w


GEMV_SWEEP = [
    dict(block_n=n, block_k=k, num_warps=w)
    for n, k, w in itertools.product((4, 8, 16), (128, 256, 512), (4, 8))
]


# --each-kernel: wider and narrower tiles too (a whole Qwen3-30B-A3B expert row of 768 in one tile).
EACH_KERNEL_SWEEP = [
    dict(block_n=n, block_k=k, num_warps=w)
    for n, k, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024), (4, 8))
]


def _calls(fn, x, weights, ids, w) -> list:
    """One call of `fn` a copy of the experts, for `graph_us`."""
    return [lambda c=c: fn(x, *c, weights, ids) for c in w]


def compare_one_token(names: list[str], top: int) -> None:
    """The one-token GEMV path, its launch swept (gate_up and down alike), beside the grouped kernels
    at their DECODE_LAUNCH, same layers, same graphs."""
    print("| family | expert bytes a token (MB) | path | us | GB/s |\n|---|---|---|---|---|")
    saved = dict(moe_decode.GATE_UP_LAUNCH), dict(moe_decode.DOWN_LAUNCH)
    for name in names:
        experts, top_k, hidden, inter = FAMILIES[name]
        active = top_k * 3 * hidden * inter * 2
        x, weights, ids, w = layers(experts, top_k, hidden, inter, copies=3)
        want = moe.fused_moe_triton(x, *w[0], weights, ids)
        grouped = graph_us(_calls(moe.fused_moe_triton, x, weights, ids, w))
        rows = []
        for launch in GEMV_SWEEP:
            moe_decode.GATE_UP_LAUNCH.update(launch)
            moe_decode.DOWN_LAUNCH.update(launch)
            got = moe_decode.one_token_moe(x, *w[0], weights, ids)
            assert (got.float() - want.float()).abs().max() <= 2e-2 * want.abs().max()
            rows.append((graph_us(_calls(moe_decode.one_token_moe, x, weights, ids, w)), launch))
        rows.sort(key=lambda r: r[0])
        print(
            f"| {name} | {active / 1e6:.1f} | grouped {moe.DECODE_LAUNCH} | {grouped:.1f} | {active / grouped / 1e3:.0f} |"
        )
        for us, launch in rows[:top]:
            print(
                f"| {name} | {active / 1e6:.1f} | one-token {launch} | {us:.1f} | {active / us / 1e3:.0f} |"
            )
        print(f"| {name} | | best one-token / grouped | {rows[0][0] / grouped:.2f}x | |", flush=True)
    moe_decode.GATE_UP_LAUNCH.update(saved[0])
    moe_decode.DOWN_LAUNCH.update(saved[1])


def sweep_each_kernel(names: list[str], top: int, kernels: list[str]) -> None:
    """The one-token path's gate_up launch swept with the down launch at its default, then the down
    launch with gate_up at its default: each kernel's best setting, the layer's time with it."""
    print("| family | kernel swept | setting | layer us | change |\n|---|---|---|---|---|")
    for name in names:
        experts, top_k, hidden, inter = FAMILIES[name]
        x, weights, ids, w = layers(experts, top_k, hidden, inter, copies=3)
        want = moe_decode.one_token_moe(x, *w[0], weights, ids)
        base = graph_us(_calls(moe_decode.one_token_moe, x, weights, ids, w))
        for kernel in kernels:
            saved = dict(getattr(moe_decode, kernel))
            rows = []
            for launch in EACH_KERNEL_SWEEP:
                getattr(moe_decode, kernel).update(launch)
                got = moe_decode.one_token_moe(x, *w[0], weights, ids)
                assert (got.float() - want.float()).abs().max() <= 2e-2 * want.abs().max()
                rows.append((graph_us(_calls(moe_decode.one_token_moe, x, weights, ids, w)), launch))
            getattr(moe_decode, kernel).clear()
            getattr(moe_decode, kernel).update(saved)
            rows.sort(key=lambda r: r[0])
            print(f"| {name} | {kernel} | default {saved} | {base:.1f} | |")
            for us, launch in rows[:top]:
                print(f"| {name} | {kernel} | {launch} | {us:.1f} | {us / base - 1:+.1%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--top", type=int, default=5, help="how many of the fastest tiles to print")
    parser.add_argument("--one-token", action="store_true", help="the GEMV path beside the grouped kernels")
    parser.add_argument("--each-kernel", action="store_true", help="with --one-token: its two launches apart")
    parser.add_argument("--kernels", nargs="+", default=["GATE_UP_LAUNCH", "DOWN_LAUNCH"],
                        choices=["GATE_UP_LAUNCH", "DOWN_LAUNCH"], help="with --each-kernel: which to sweep")  # fmt: skip
    args = parser.parse_args()
    moe.ONE_TOKEN_GEMV = False  # fused_moe_triton below is the grouped kernels; the GEMVs are called directly
    if args.one_token and args.each_kernel:
        sweep_each_kernel(args.families, args.top, args.kernels)
        return
    if args.one_token:
        compare_one_token(args.families, args.top)
        return
    default = dict(moe.DECODE_LAUNCH)
    print("| family | expert bytes a token (MB) | launch | us | GB/s |\n|---|---|---|---|---|")
    for name in args.families:
        experts, top_k, hidden, inter = FAMILIES[name]
        active = top_k * 3 * hidden * inter * 2
        # Three copies of the experts: the chosen ones of one copy (75-700 MB) already exceed L2.
        x, weights, ids, w = layers(experts, top_k, hidden, inter, copies=3)
        want = moe.fused_moe_triton(x, *w[0], weights, ids)
        rows = []
        for launch in [default] + SWEEP:
            moe.DECODE_LAUNCH.update(launch)
            try:
                got = moe.fused_moe_triton(x, *w[0], weights, ids)
            except Exception as error:  # a tile that does not fit shared memory
                print(f"| {name} | | {launch} | failed: {type(error).__name__} | |")
                continue
            assert (got.float() - want.float()).abs().max() <= 2e-2 * want.abs().max()
            us = graph_us([lambda c=c, x=x, r=(weights, ids): moe.fused_moe_triton(x, *c, *r) for c in w])
            rows.append((us, launch))
        moe.DECODE_LAUNCH.update(default)
        rows.sort(key=lambda r: r[0])
        base = next(us for us, launch in rows if launch == default)
        for us, launch in [(base, default)] + [r for r in rows if r[1] != default][: args.top]:
            tag = "default" if launch == default else launch
            print(f"| {name} | {active / 1e6:.1f} | {tag} | {us:.1f} | {active / us / 1e3:.0f} |")
        print(f"| {name} | | best / default | {rows[0][0] / base:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
