"""Per-architecture configs of the tiny fixture models: 2-4 layers, hidden 64, 4 heads of 16.

Each builder keeps the family's distinguishing feature small enough to matter in tests: GQA with 2 KV
heads where the family has it, Mistral's sliding window of 16 tokens, Gemma 2's alternating
local/global layers with both softcaps, GPT-BigCode's and Falcon's multi-query attention, GPT-NeoX's
partial rotary, Mixtral's 4 experts routed top-2. Tied embeddings follow each family's usual
checkpoints (GPT-2, GPT-BigCode, OPT, Falcon, Gemma 2, and Qwen3 as in Qwen3-0.6B), so the loader's
tying path is exercised too.

`INIT_STD` is the weight initialisation std for every family (the HF default is 0.02). At 0.02 a tiny
model's layers add almost nothing to the token embedding: logits are small and near-tied, and with tied
embeddings greedy decoding repeats the last token forever. At 0.15 the layers dominate the residual
stream, logits spread over several units and greedy outputs vary with context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tgserve.server.loading.hf_compat import set_config_dtype

INIT_STD = 0.15
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
LAYERS = 2
MAX_POSITIONS = 512
SLIDING_WINDOW = 16
CONSTANT_PARAM_NOISE = 0.1


@dataclass(frozen=True)
class TokenIds:
    """The shared tokenizer's size and special ids, written into every config."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    def as_kwargs(self) -> dict[str, int]:
        """The four values as config keyword arguments."""
        return {
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }


def _llama_like(ids: TokenIds, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments shared by the Llama-style families (RMSNorm, SwiGLU, rotary, GQA)."""
    kwargs: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        **ids.as_kwargs(),
    )
    kwargs.update(overrides)
    return kwargs


def llama(ids: TokenIds) -> Any:
    """Llama: GQA (4 query heads, 2 KV heads), untied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(**_llama_like(ids, head_dim=HEAD_DIM))


def mistral(ids: TokenIds) -> Any:
    """Mistral: Llama plus a 16-token sliding window on every layer."""
    from transformers import MistralConfig

    return MistralConfig(**_llama_like(ids, head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW))


def qwen2(ids: TokenIds) -> Any:
    """Qwen2: Llama plus biases on the q/k/v projections."""
    from transformers import Qwen2Config

    return Qwen2Config(**_llama_like(ids, use_sliding_window=False, sliding_window=None))


def qwen3(ids: TokenIds) -> Any:
    """Qwen3: per-head q/k RMSNorm, explicit head_dim, tied embeddings (as Qwen3-0.6B)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        **_llama_like(
            ids, head_dim=HEAD_DIM, use_sliding_window=False, sliding_window=None, tie_word_embeddings=True
        )
    )


def gemma2(ids: TokenIds) -> Any:
    """Gemma 2: sliding (even) and global (odd) layers, attention and final logit softcapping."""
    from transformers import Gemma2Config

    layers = 4
    return Gemma2Config(
        **_llama_like(
            ids,
            num_hidden_layers=layers,
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )


def phi3(ids: TokenIds) -> Any:
    """Phi-3: fused qkv and gate/up projections, GQA."""
    from transformers import Phi3Config

    return Phi3Config(**_llama_like(ids, original_max_position_embeddings=MAX_POSITIONS, sliding_window=None))


def mixtral(ids: TokenIds) -> Any:
    """Mixtral: 4 experts per layer, 2 routed per token."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **_llama_like(ids, head_dim=HEAD_DIM, sliding_window=None, num_local_experts=4, num_experts_per_tok=2)
    )


def gpt2(ids: TokenIds) -> Any:
    """GPT-2: learned positions, fused c_attn (Conv1D), tied embeddings."""
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=MAX_POSITIONS,
        initializer_range=INIT_STD,
        **ids.as_kwargs(),
    )


def gpt_bigcode(ids: TokenIds) -> Any:
    """GPT-BigCode (StarCoder): multi-query attention (one KV head), tied embeddings."""
    from transformers import GPTBigCodeConfig

    return GPTBigCodeConfig(
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=MAX_POSITIONS,
        multi_query=True,
        initializer_range=INIT_STD,
        **ids.as_kwargs(),
    )


def gpt_neox(ids: TokenIds) -> Any:
    """GPT-NeoX (Pythia): parallel residual, rotary on a quarter of each head."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        use_parallel_residual=True,
        # Pythia's own config keys: transformers 4.x reads them as they are, 5.x folds them into
        # `rope_parameters` (which 4.x would ignore).
        rotary_pct=0.25,
        rotary_emb_base=10000.0,
        **ids.as_kwargs(),
    )


def falcon(ids: TokenIds) -> Any:
    """Falcon-7B's layout: rotary (no ALiBi), multi-query, parallel attention and MLP, no biases.

    The new decoder architecture (Falcon-40B) is avoided: transformers broadcasts its grouped KV heads
    to all query heads before caching, so its cache would not be the model's real GQA layout.
    """
    from transformers import FalconConfig

    return FalconConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        alibi=False,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
        bias=False,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        **ids.as_kwargs(),
    )


def opt(ids: TokenIds) -> Any:
    """OPT-125m's layout: pre-LayerNorm, biases, learned positions (offset by 2), ReLU."""
    from transformers import OPTConfig

    return OPTConfig(
        hidden_size=HIDDEN,
        ffn_dim=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        do_layer_norm_before=True,
        word_embed_proj_dim=HIDDEN,
        init_std=INIT_STD,
        **ids.as_kwargs(),
    )


CONFIG_BUILDERS: dict[str, Callable[[TokenIds], Any]] = {
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma2": gemma2,
    "phi3": phi3,
    "gpt_bigcode": gpt_bigcode,
    "gpt2": gpt2,
    "gpt_neox": gpt_neox,
    "falcon": falcon,
    "opt": opt,
    "mixtral": mixtral,
}

ARCHITECTURE_CLASSES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "falcon": "FalconForCausalLM",
    "opt": "OPTForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def build_config(arch: str, ids: TokenIds) -> Any:
    """The float32 config of `arch`, with `architectures` set; KeyError names the known architectures."""
    if arch not in CONFIG_BUILDERS:
        raise KeyError(f"unknown fixture architecture {arch!r}; known: {', '.join(CONFIG_BUILDERS)}")
    config = CONFIG_BUILDERS[arch](ids)
    config.architectures = [ARCHITECTURE_CLASSES[arch]]
    set_config_dtype(config, "float32")
    return config


NORM_WEIGHT_OFFSETS: dict[str, float] = {"gemma2": 2.0}


def finish_init(arch: str, model: Any) -> None:
    """Randomise what HF initialises to constants, then apply per-family offsets.

    Biases start at 0 and norm weights at 1 (or 0 in Gemma's `1 + w` norms); left so, a loader that
    forgets to load them would still pass parity tests. Gemma 2 multiplies embeddings by sqrt(hidden)
    and normalises every sublayer's output, so with tied embeddings the current token dominates and
    greedy decoding repeats it; tripling its norm weights (offset 2.0) lets the layers outweigh it.
    """
    import torch

    offset = NORM_WEIGHT_OFFSETS.get(arch, 0.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 1:
                continue
            param.add_(torch.randn_like(param) * CONSTANT_PARAM_NOISE)
            if offset and "norm" in name:
                param.add_(offset)
