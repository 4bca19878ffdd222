"""The one boundary between tgserve and Habana's bridge (`habana_frameworks`).

Everything on a Gaudi that is not plain torch goes through a `HabanaOps`: the fused attention
kernel, the lazy-mode step marker, HPU graph wrapping. `GaudiOps` is the real one and imports
`habana_frameworks` only when one of its methods first runs, so importing this module (or anything
that holds a `GaudiOps`) never touches the bridge. Tests replace the whole boundary by handing code
another `HabanaOps` (`tgserve.server.testing.habana_stand_in.TorchStandInOps`), never by patching the bridge.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Protocol

import torch
from torch import nn


class HabanaOps(Protocol):
    """What tgserve asks of Habana's bridge; shapes are torch's SDPA convention."""

    def fused_sdpa(
        self,
        query: torch.Tensor,  # [batch, num_heads, q_len, head_dim]
        key: torch.Tensor,  # [batch, num_kv_heads, k_len, head_dim]; num_heads % num_kv_heads == 0
        value: torch.Tensor,  # [batch, num_kv_heads, k_len, head_dim]
        attn_bias: torch.Tensor | None,  # additive, query's dtype, broadcastable to [b, h, q, k]
        is_causal: bool,  # top-left causal over q_len == k_len; only with attn_bias None
        scale: float,
    ) -> torch.Tensor:  # [batch, num_heads, q_len, head_dim]
        """Softmax attention in one fused kernel (FusedSDPA on a Gaudi)."""
        ...

    def mark_step(self) -> None:
        """End of a lazy-mode step: the ops queued so far are compiled (once per shape) and run."""
        ...

    def wrap_in_hpu_graph(self, module: nn.Module) -> nn.Module:
        """The module, replayed as an HPU graph per input shape after its first call."""
        ...


def is_available() -> bool:
    """True on a machine with the Habana bridge installed and a Gaudi visible.

    The spec lookup comes first so that, where the bridge is not installed, nothing is imported.
    """
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    import habana_frameworks.torch.hpu as hthpu

    return bool(hthpu.is_available())


@functools.cache
def _fused_sdpa_kernel() -> Any:
    from habana_frameworks.torch.hpex.kernels import FusedSDPA

    return FusedSDPA


class GaudiOps:
    """The real boundary: Habana's kernels, each imported on first use."""

    # "None" is FusedSDPA's exact softmax ("fast" trades accuracy for speed in bf16); recompute
    # mode is its flash-style tiling, which never materialises the [q_len, k_len] scores.
    softmax_mode = "None"
    recompute_mode = True

    def fused_sdpa(self, query, key, value, attn_bias, is_causal, scale):
        # Grouped-query key/value go in as they are: FusedSDPA takes num_kv_heads < num_heads since
        # SynapseAI 1.17 (vllm-hpu-extension's fsdpa path relies on it).
        return _fused_sdpa_kernel().apply(
            query,
            key,
            value,
            attn_bias,
            0.0,  # dropout_p
            is_causal,
            scale,
            self.softmax_mode,
            self.recompute_mode,
        )

    def mark_step(self) -> None:
        import habana_frameworks.torch.core as htcore

        htcore.mark_step()

    def wrap_in_hpu_graph(self, module: nn.Module) -> nn.Module:
        import habana_frameworks.torch.hpu as hthpu

        # Without the tensor cache the graph does not keep every intermediate alive between replays.
        return hthpu.wrap_in_hpu_graph(module, disable_tensor_cache=True)
