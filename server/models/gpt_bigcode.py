"""GPT-BigCode (StarCoder): multi-query attention with one KV head, learned absolute positions.

Its fused c_attn is [queries | key | value] under multi-query, and per-head interleaved otherwise.
The engine's KV cache spec gives it one KV head; nothing here knows how the cache is laid out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from tgserve.server.attention.forward_context import paged_attention
from tgserve.server.models.layers import FusedWeightLoader


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.multi_query = bool(config.multi_query)
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.num_kv_heads = 1 if self.multi_query else self.num_heads
        kv_dim = self.num_kv_heads * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * kv_dim)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.multi_query:
            q, k, v = qkv.split([self.num_heads * self.head_dim, self.head_dim, self.head_dim], dim=-1)
            return (
                q.view(-1, self.num_heads, self.head_dim),
                k.view(-1, 1, self.head_dim),
                v.view(-1, 1, self.head_dim),
            )
        q, k, v = qkv.view(-1, self.num_heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        return q, k, v

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.c_attn(hidden))
        out = paged_attention(self.layer_idx, q.contiguous(), k.contiguous(), v.contiguous(), self.scale)
        return self.c_proj(out.reshape(hidden.shape[0], -1))


class GPTBigCodeMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.c_proj = nn.Linear(inner, config.n_embd)
        self.act = ACT2FN[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPTBigCodeAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPTBigCodeMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class GPTBigCodeModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPTBigCodeBlock(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden)
        return self.ln_f(hidden)


class GPTBigCodeForCausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPTBigCodeModel(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.transformer(input_ids, positions)[logits_indices]
        return hidden @ self.transformer.wte.weight.t()  # lm_head is tied to the embeddings

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = FusedWeightLoader(self, stacked={}, shard_sizes={})
        loader.load((n, t) for n, t in weights if n != "lm_head.weight")
        loader.check_complete()
