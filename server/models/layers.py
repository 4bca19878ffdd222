"""Building blocks shared by the native models: norms, rotary embeddings and fused-weight loading."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tgserve.kernels import dispatch


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the HF implementations do.

    Given a residual, the residual stream's add comes first and the call returns
    (norm(x + residual), x + residual): on CUDA the add and the norm are then one kernel, which
    writes the two over x and residual. The caller passes tensors it no longer needs.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return dispatch.rms_norm(x, self.weight, self.eps)
        return dispatch.fused_add_rms_norm(x, residual, self.weight, self.eps, in_place=True)


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings from a transformers 5 (`rope_parameters`) or 4.x (`rope_theta`, `rope_scaling`) config."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return {**scaling, "rope_type": rope_type, "rope_theta": getattr(config, "rope_theta", 10000.0)}


def rope_inverse_frequencies(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, for default RoPE and transformers' scaled types."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling changes with the sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq, float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX style) rotary embedding applied at explicit positions.

    One instance is shared by all layers of a model: cos/sin are computed once per forward pass
    (memoised on the positions tensor, which the runner makes anew each step).
    """

    def __init__(
        self, config: Any, head_dim: int, frequencies: tuple[torch.Tensor, float] | None = None
    ) -> None:
        """frequencies: (inverse frequencies, cos/sin scaling) where the model computes its own
        (per layer type, as Gemma 3's); else read off the config (`rope_inverse_frequencies`)."""
        super().__init__()
        inv_freq, self.scaling = frequencies or rope_inverse_frequencies(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, [T, 1, D], for the step's positions."""
        if self._memo is not None and self._memo[0] is positions:
            return self._memo[1], self._memo[2]
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
        self._memo = (positions, cos, sin)
        return cos, sin

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        rows: slice | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, H_kv, D] at `positions` [T], or with `rows`, a slice of the
        step's rows at `positions[rows]` (cos/sin stay memoised on the whole step's positions);
        with `out`, written there. qk_norm: per-head RMSNorm weights of query and key, and eps,
        applied before the rotation (`dispatch.rotary`)."""
        cos, sin = self.cos_sin(positions, query.dtype)
        if rows is not None:
            cos, sin = cos[rows], sin[rows]
        return dispatch.rotary(query, key, cos, sin, out, qk_norm)


class FusedWeightLoader:
    """Copies checkpoint tensors into a model whose parameters fuse several checkpoint tensors.

    `stacked` maps a checkpoint module name (e.g. "q_proj") to (fused module name, shard index), and
    `shard_sizes[fused module name]` gives each shard's rows. Missing or unexpected weights raise with their names.
    """

    def __init__(
        self,
        model: nn.Module,
        stacked: dict[str, tuple[str, int]],
        shard_sizes: dict[str, list[int]],
        ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"),
    ) -> None:
        self.params = dict(model.named_parameters())
        self.stacked = stacked
        self.shard_sizes = shard_sizes
        self.ignored_suffixes = ignored_suffixes
        self.loaded: set[str] = set()

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if name.endswith(self.ignored_suffixes):
                continue
            self._load_one(name, tensor)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        for part, (fused, shard) in self.stacked.items():
            if f".{part}." in name:
                target = name.replace(f".{part}.", f".{fused}.")
                self._copy(self._param(target, name), tensor, fused, shard)
                self.loaded.add(f"{target}#{shard}")
                return
        self._copy(self._param(name, name), tensor, None, None)
        self.loaded.add(name)

    def _copy(self, param: nn.Parameter, tensor: torch.Tensor, fused: str | None, shard: int | None) -> None:
        """Into `param`: its own loader's slice (sharded layers), else shard `shard`'s rows, else all."""
        if hasattr(param, "weight_loader"):
            param.weight_loader(param, tensor, shard)
        elif shard is None:
            param.data.copy_(tensor)
        else:
            sizes = self.shard_sizes[fused]
            start = sum(sizes[:shard])
            param.data[start : start + sizes[shard]].copy_(tensor)

    def _param(self, target: str, source: str) -> nn.Parameter:
        if target not in self.params:
            raise ValueError(f"checkpoint weight {source!r} has no place in this model")
        return self.params[target]

    def check_complete(self) -> None:
        expected = set()
        for name in self.params:
            module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
            fused = module if module in self.shard_sizes else None
            if fused is None:
                expected.add(name)
            else:
                expected.update(f"{name}#{i}" for i in range(len(self.shard_sizes[fused])))
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")
