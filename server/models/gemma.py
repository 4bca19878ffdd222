"""Gemma 2 and Gemma 3 (text), native: the llama family's fused projections and paged attention,
with Gemma's parts.

What differs from Llama: RMSNorm scales by (1 + weight), computed in float32; a norm after
attention and around the MLP as well as before (four a layer); GELU (tanh) gating; the embeddings
scaled by sqrt(hidden size); attention scaled by `query_pre_attn_scalar`; sliding-window layers
among full ones (`layer_types`, which the KV cache's specs already read); tied embeddings. Gemma 2
soft-caps the attention scores and the final logits (tanh). Gemma 3 norms each head's queries and
keys, and rotates them with a RoPE of its own per layer type (local layers a base of 10,000,
global ones 1,000,000, some models' global ones scaled linearly).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from tgserve.kernels import dispatch
from tgserve.server.attention.forward_context import paged_attention
from tgserve.server.distributed.tensor_parallel import tensor_parallel
from tgserve.server.kv_cache.spec import head_dim, num_kv_heads
from tgserve.server.models.layers import RotaryEmbedding
from tgserve.server.models.llama import load_fused_weights
from tgserve.server.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    lm_head_logits,
)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back (Gemma's order: Llama casts before scaling)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.gemma_rms_norm(x, self.weight, self.eps)


def is_gemma3(config: Any) -> bool:
    return config.model_type in ("gemma3_text", "gemma3")


def layer_rotaries(config: Any) -> list[RotaryEmbedding]:
    """Each layer's RoPE: one for all (Gemma 2); one per layer type (Gemma 3), shared by its layers."""
    dim = head_dim(config)
    if not is_gemma3(config):
        return [RotaryEmbedding(config, dim)] * config.num_hidden_layers
    by_type = {kind: RotaryEmbedding(config, dim, gemma3_frequencies(config, kind, dim))
               for kind in set(config.layer_types)}  # fmt: skip
    return [by_type[kind] for kind in config.layer_types[: config.num_hidden_layers]]


def gemma3_frequencies(config: Any, layer_type: str, dim: int) -> tuple[torch.Tensor, float]:
    """A Gemma 3 layer type's inverse frequencies: transformers 5's `rope_parameters[layer_type]`,
    or 4.x's `rope_local_base_freq` (sliding layers) and `rope_theta` with `rope_scaling` (full
    ones). Default and linear RoPE, the types Gemma 3 uses; others are refused by name."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type in params:
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    else:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        params = {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                  "factor": scaling.get("factor", 1.0), "rope_theta": config.rope_theta}  # fmt: skip
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "linear"):
        raise ValueError(f"Gemma 3 with {rope_type} RoPE on its {layer_type} layers is not supported")
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return (inv_freq / params["factor"] if rope_type == "linear" else inv_freq), 1.0


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        tp = tensor_parallel()  # this shard's heads, as the llama family splits them
        self.num_heads = tp.divide(config.num_attention_heads, "attention heads")
        self.num_kv_heads = tp.divide(num_kv_heads(config), "KV heads")
        self.head_dim = head_dim(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        full_q, full_kv = self.q_size * tp.world_size, self.kv_size * tp.world_size
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [full_q, full_kv, full_kv], bias)
        self.o_proj = RowParallelLinear(full_q, config.hidden_size, bias)
        self.rotary = rotary
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        qk_norm = is_gemma3(config)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(self.layer_idx, q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), self.scale,
                              self.softcap)  # fmt: skip
        return self.o_proj(out.reshape(-1, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False)
        # Gemma 2 and 3 gate with tanh GELU: one fused kernel on a GPU; any other activation as given.
        self.tanh_gelu = config.hidden_activation == "gelu_pytorch_tanh"
        self.act = ACT2FN[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.tanh_gelu:
            return self.down_proj(dispatch.gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_idx, rotary)
        self.mlp = GemmaMLP(config)
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden))
        # hidden + post_attention_layernorm(attended), and that normed for the MLP, in one pass
        hidden, mlp_input = dispatch.gemma_norm_add(
            attended, hidden, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
            self.pre_feedforward_layernorm.weight,
        )  # fmt: skip
        post = self.post_feedforward_layernorm
        return dispatch.gemma_norm_add(self.mlp(mlp_input), hidden, post.weight, post.eps)[0]


class GemmaModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotaries = layer_rotaries(config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, rotaries[i]) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size**0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale in the embeddings' dtype first, as transformers rounds it (bf16: 48.0 for 2304).
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class GemmaForCausalLM(nn.Module):
    """Flat-batch causal LM (Gemma 2, Gemma 3's text model), as the llama family's, tensor-parallel
    as it is."""

    supports_tensor_parallel = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions)[logits_indices]
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = lm_head_logits(hidden, weight, self.config.vocab_size)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_fused_weights(self, weights)
