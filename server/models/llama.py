"""The llama family (Llama, Mistral, Qwen2, Qwen3): fused QKV and gate/up projections, paged attention.

Differences between the families are flags read off the config: Qwen2 biases its QKV projection,
Qwen3 normalises queries and keys per head, Mistral's window comes through the KV cache spec,
gpt-oss (`gpt_oss.py`) biases every projection and learns a sink logit per head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from tgserve.kernels import dispatch
from tgserve.server.attention.forward_context import paged_attention
from tgserve.server.distributed.tensor_parallel import tensor_parallel
from tgserve.server.kv_cache.spec import head_dim, num_kv_heads
from tgserve.server.models.layers import FusedWeightLoader, RMSNorm, RotaryEmbedding, rope_parameters
from tgserve.server.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    lm_head_logits,
)


def _family_flags(config: Any) -> dict[str, bool]:
    model_type = config.model_type
    attention_bias = bool(getattr(config, "attention_bias", False))
    qwen2 = model_type in ("qwen2", "qwen2_moe")
    return {
        "qkv_bias": bool(getattr(config, "qkv_bias", True)) if qwen2 else attention_bias,
        "o_bias": False if qwen2 else attention_bias,
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        "sinks": model_type == "gpt_oss",  # a learned sink logit per head
    }


# A long step's rows go through the token-wise parts of a layer (projections, query/key norms, rotary,
# MLP) this many at a time, so that a whole prompt's step holds the layer's hidden-size tensors and
# no wider ones: at 1M tokens of an 8B model the fused QKV output alone is 12 GiB and the gate/up
# output 56 GiB, memory the KV pool is sized without. A GEMM of this many rows runs as fast per row.
ROWS_AT_ONCE = 16384


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        flags = _family_flags(config)
        self.layer_idx = layer_idx
        tp = tensor_parallel()
        # This shard's heads: query and KV heads are split evenly across the shards.
        self.num_heads = tp.divide(config.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.divide(num_kv_heads(config), "KV heads")
        self.head_dim = head_dim(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        full_q, full_kv = self.q_size * tp.world_size, self.kv_size * tp.world_size
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [full_q, full_kv, full_kv], flags["qkv_bias"]
        )
        self.o_proj = RowParallelLinear(full_q, config.hidden_size, flags["o_bias"])
        # (applied by the rotary, `_qkv`; modules for their checkpoint names)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags["qk_norm"] else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if flags["qk_norm"] else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.sinks = self._sinks(tp) if flags["sinks"] else None

    def _sinks(self, tp: Any) -> nn.Parameter:
        """This shard's heads' sink logits (float32: they join the softmax's sums)."""
        sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        start = tp.rank * self.num_heads

        def load(param: nn.Parameter, tensor: torch.Tensor, part: int | None) -> None:
            param.data.copy_(tensor.narrow(0, start, self.num_heads))

        sinks.weight_loader = load  # type: ignore[attr-defined]
        return sinks

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """keep: the rows whose output is used (every row's keys and values are cached).

        A step of more than ROWS_AT_ONCE rows computes its queries, keys and values a slice at a
        time into whole-step tensors, attends over the whole step (into `hidden`'s memory where the
        backend can and the shapes allow), and projects the output a slice at a time into `hidden`,
        which it overwrites (its caller has no further use for it)."""
        if hidden.shape[0] <= ROWS_AT_ONCE:
            q, k, v = self._qkv(positions, hidden)
            out = paged_attention(self.layer_idx, q, k, v, self.scale, rows=keep, sinks=self.sinks)
            return self.o_proj(out.reshape(-1, self.q_size))
        q, k, v = self._qkv_in_slices(positions, hidden)
        # The normed input is dead once projected: the output may take its place (o_proj reads a
        # slice of it before that slice is written).
        over_input = keep is None and self.q_size == hidden.shape[1] and hidden.is_contiguous()
        buffer = hidden.view(-1, self.num_heads, self.head_dim) if over_input else None
        out = paged_attention(
            self.layer_idx, q, k, v, self.scale, rows=keep, out=buffer, sinks=self.sinks
        ).reshape(-1, self.q_size)
        del q, k, v  # stored in the KV cache: only the output goes on
        projected = hidden if keep is None else hidden.new_empty(out.shape[0], hidden.shape[1])
        for start in range(0, out.shape[0], ROWS_AT_ONCE):
            projected[start : start + ROWS_AT_ONCE] = self.o_proj(out[start : start + ROWS_AT_ONCE])
        return projected

    def _qkv(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rows: slice | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Rotated queries [T, H, D] and keys [T, H_kv, D], and values [T, H_kv, D], of `hidden`'s
        rows, or of the slice `rows` of them (`positions` stays the whole step's); with `out`, the
        queries and keys are written into it."""
        if rows is not None:
            hidden = hidden[rows]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qk_norm = None  # Qwen3's per-head norms, in the rotary's launch
        if self.q_norm is not None:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = self.rotary(positions, q, k, rows, out, qk_norm)
        return q, k, v

    def _qkv_in_slices(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`_qkv` over ROWS_AT_ONCE rows at a time, into tensors of the whole step."""
        rows = hidden.shape[0]
        q = hidden.new_empty(rows, self.num_heads, self.head_dim)
        k = hidden.new_empty(rows, self.num_kv_heads, self.head_dim)
        v = torch.empty_like(k)
        for start in range(0, rows, ROWS_AT_ONCE):
            part = slice(start, start + ROWS_AT_ONCE)
            v[part] = self._qkv(positions, hidden, part, out=(q[part], k[part]))[2]
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, intermediate_size: int | None = None) -> None:
        """intermediate_size: where not the config's (a mixture of experts' shared expert)."""
        super().__init__()
        bias = _family_flags(config)["mlp_bias"]
        full = intermediate_size or config.intermediate_size
        self.intermediate = tensor_parallel().divide(full, "intermediate size")  # this shard's
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [full, full], bias)
        self.down_proj = RowParallelLinear(full, config.hidden_size, bias)
        # SiLU gating has a fused kernel on CUDA; other activations stay with transformers'.
        self.act = None if config.hidden_act in ("silu", "swish") else ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= ROWS_AT_ONCE:
            return self._rows(x)
        out = x.new_empty(x.shape[0], self.down_proj.weight.shape[0])
        for start in range(0, x.shape[0], ROWS_AT_ONCE):
            out[start : start + ROWS_AT_ONCE] = self._rows(x[start : start + ROWS_AT_ONCE])
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is None:
            return self.down_proj(dispatch.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module | None = None
    ) -> None:
        """mlp: the layer's feed-forward block where it is not Llama's (a mixture of experts)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.mlp = LlamaMLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added).

        The stream's adds are deferred into the next norm (vLLM's layout) so that on CUDA each add
        and the norm after it are one kernel; the first layer has no pending add. keep: only these
        rows go on past the attention kernel (every row's keys and values are cached all the same).
        """
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, keep)
        if keep is not None:
            residual = residual[keep]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, mlp_of: Callable[[Any, int], nn.Module | None] | None = None) -> None:
        """mlp_of(config, layer index): a layer's own feed-forward block, or None for Llama's."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, head_dim(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, mlp_of(config, i) if mlp_of else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states of every token, or with keep of those rows only, in keep's order."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, keep if i == last else None)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Flat-batch causal LM: all scheduled tokens of all requests in one [num_tokens] input.

    Llama, Mistral, Qwen2, Qwen3 and Phi-3 (Llama's layers with its projections fused in the
    checkpoint, `qkv_proj` and `gate_up_proj`, split on load)."""

    supports_tensor_parallel = True
    # A subclass's feed-forward block per layer (mixtures of experts); None: Llama's MLP everywhere.
    mlp_of: Callable[[Any, int], nn.Module | None] | None = None

    @staticmethod
    def serves(config: Any) -> bool:
        """Every configuration but RoPE that this implementation does not compute: scaling whose
        frequencies change with the sequence's length (Phi-3's `longrope`, dynamic NTK), or rotary
        over part of each head (`partial_rotary_factor`); transformers' fallback serves those."""
        rope_type = rope_parameters(config).get("rope_type", "default")
        partial = float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
        return rope_type not in ("longrope", "dynamic") and partial == 1.0

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self).mlp_of)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        if logits_indices.shape[0] < input_ids.shape[0]:
            # Rows no logit reads skip the last layer's output projection and MLP (as llama.cpp
            # prunes its output rows): a 128K-token prompt's first token runs them over one row.
            hidden = self.model(input_ids, positions, keep=logits_indices)
        else:  # decode: every row is read
            hidden = self.model(input_ids, positions)[logits_indices]
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return lm_head_logits(hidden, weight, self.config.vocab_size)  # [len(logits_indices), vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_fused_weights(self, weights)


def load_fused_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], placed_elsewhere: Iterable[str] = ()
) -> None:
    """A checkpoint's weights into a model of the llama family's fused projections (`qkv_proj`,
    `gate_up_proj`: its `model.layers[i].self_attn` has `q_size` and `kv_size` per shard), the LM
    head left out where the embeddings are tied; any missing or misplaced weight named.
    placed_elsewhere: parameters the caller fills itself (from `weights` as they pass) and checks."""
    attn, config = model.model.layers[0].self_attn, model.config
    loader = FusedWeightLoader(
        model,
        stacked={
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        },
        shard_sizes={
            "qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
            "gate_up_proj": [config.intermediate_size] * 2,
        },
    )
    tied = model.tie_word_embeddings
    weights = _unfused(weights, attn, config.intermediate_size)
    loader.load((n, t) for n, t in weights if not (tied and n == "lm_head.weight"))
    loader.loaded.update(placed_elsewhere)
    loader.check_complete()


def _unfused(
    weights: Iterable[tuple[str, torch.Tensor]], attn: nn.Module, intermediate_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints with fused projections (Phi-3's `qkv_proj`, `gate_up_proj`) as the separate
    ones the loader places (each shard taking its own rows of each part)."""
    shards = tensor_parallel().world_size
    parts = {
        ".qkv_proj.": ([".q_proj.", ".k_proj.", ".v_proj."],
                       [s * shards for s in (attn.q_size, attn.kv_size, attn.kv_size)]),
        ".gate_up_proj.": ([".gate_proj.", ".up_proj."], [intermediate_size] * 2),
    }  # fmt: skip
    for name, tensor in weights:
        fused = next((f for f in parts if f in name), None)
        if fused is None:
            yield name, tensor
            continue
        names, sizes = parts[fused]
        # A scale of the whole fused tensor (an fp8 checkpoint's per-tensor one) is each part's.
        whole = tensor.dim() == 0 or tensor.shape[0] != sum(sizes)
        pieces = [tensor] * len(names) if whole else tensor.split(sizes, dim=0)
        for part, piece in zip(names, pieces, strict=True):
            yield name.replace(fused, part), piece
