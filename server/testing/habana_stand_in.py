"""`TorchStandInOps`: the replacement for the Habana boundary (`tgserve.server.device.habana`) in tests.

It computes what each Habana op computes, in plain torch on any device, and records which ops ran,
so CPU tests exercise every line of the HPU backend except `GaudiOps` itself.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn


class TorchStandInOps:
    """A `HabanaOps` in plain torch: FusedSDPA is torch's SDPA, a step mark and graph wrapping do nothing."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.graphs: ShapeKeyedGraphs | None = None  # the last module wrapped
        self.last_is_causal: bool | None = None  # of the last fused_sdpa call

    def fused_sdpa(self, query, key, value, attn_bias, is_causal, scale):
        self.calls["fused_sdpa"] += 1
        self.last_is_causal = is_causal
        if is_causal and attn_bias is not None:
            raise ValueError("FusedSDPA takes either is_causal or a mask, not both")
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_bias, is_causal=is_causal, scale=scale, enable_gqa=True
        )

    def mark_step(self) -> None:
        self.calls["mark_step"] += 1

    def wrap_in_hpu_graph(self, module: nn.Module) -> nn.Module:
        self.calls["wrap_in_hpu_graph"] += 1
        self.graphs = ShapeKeyedGraphs(module)
        return self.graphs


class ShapeKeyedGraphs(nn.Module):
    """Stands in for a module wrapped in HPU graphs: the first call with a set of input shapes is a
    capture, later calls with those shapes are replays (the module runs eagerly either way)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.captured: set[tuple] = set()
        self.replays = 0

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        key = tuple(tuple(a.shape) for a in args)
        if key in self.captured:
            self.replays += 1
        else:
            self.captured.add(key)
        return self.module(*args)
