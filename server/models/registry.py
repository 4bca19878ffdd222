"""Lazy registry from HF `architectures` names to implementations.

Native implementations are imported only when a model needs them. Every other decoder-only
architecture transformers knows runs through the transformers fallback.
"""

from __future__ import annotations

import importlib
from typing import Any

from tgserve.server.loading.errors import ModelLoadError

# HF architecture name -> (module under tgserve.server.models, class name)
NATIVE_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "LlamaForCausalLM"),  # fused qkv / gate_up weights, split on load
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),  # Gemma 3's text model
    "GPTBigCodeForCausalLM": ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "MoEForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "MoEForCausalLM"),
    "MixtralForCausalLM": ("moe", "MoEForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is neither native nor a decoder-only transformers architecture."""


def _transformers_causal_lm_names() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def architecture_name(config: Any) -> str:
    """The HF architecture of a config; GGUF configs carry only `model_type`, mapped here."""
    architectures = getattr(config, "architectures", None)
    if architectures:
        return architectures[0]
    name = _transformers_causal_lm_names().get(getattr(config, "model_type", ""))
    if name is None:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r} names no causal-LM architecture known to transformers"
        )
    return name


def native_model_class(architecture: str, config: Any = None) -> type | None:
    """The native implementation of `architecture`, imported on first use; None if there is none,
    or (given the `config`) if it does not serve this configuration of the architecture (its
    `serves(config)`: e.g. Phi-3's long-context RoPE, which changes with the sequence's length)."""
    entry = NATIVE_MODELS.get(architecture)
    if entry is None:
        return None
    model_class = getattr(importlib.import_module(f"tgserve.server.models.{entry[0]}"), entry[1])
    serves = getattr(model_class, "serves", None)
    if config is not None and serves is not None and not serves(config):
        return None
    return model_class


def check_supported(architecture: str, trust_remote_code: bool) -> None:
    """Raise UnsupportedModelError unless the architecture can be served natively or by the fallback."""
    if architecture in NATIVE_MODELS or trust_remote_code:
        return
    if architecture in set(_transformers_causal_lm_names().values()):
        return
    raise UnsupportedModelError(
        f"architecture {architecture!r} is not supported: tgserve serves {sorted(NATIVE_MODELS)} natively "
        "and any decoder-only architecture of the installed transformers through its fallback "
        "(or one with remote code, with --trust-remote-code)"
    )


# Attention that is not one softmax over one layer's keys and values, by model type: DiffLlama's
# differential attention attends twice a layer with the same keys and two different values, and the
# paged cache holds one set a layer (found by the architecture sweep, docs/architectures.md). Not
# every second call is wrong: HRM runs its layers several times a step, each call's keys and values
# replacing the last, as its own cache does.
NOT_ONE_ATTENTION_A_LAYER = {
    "diffllama": "differential attention (two softmaxes a layer, two sets of values)"
}

# Draft models of speculative decoding that attend over their target model's keys and values: served
# alone, there are none to attend over.
_GEMMA_4_DRAFT = (
    "a draft model of Gemma 4's speculative decoding: it attends over its target model's keys and values, "
    "which it does not compute itself"
)
NEEDS_A_TARGET_MODEL = {"gemma4_assistant": _GEMMA_4_DRAFT, "gemma4_unified_assistant": _GEMMA_4_DRAFT}

# Settings a model type cannot run without, in transformers as here, and what each is: named when the
# model loads rather than by the first forward's error.
REQUIRED_SETTINGS = {
    "xmod": (
        "default_language",
        "the language adapter a request without language ids runs through (X-MOD's "
        'set_default_language), e.g. "en_XX"',
    ),
}


def check_required_settings(config: Any, architecture: str) -> None:
    """Raise ModelLoadError where the config lacks a setting the model type cannot run without."""
    needed = REQUIRED_SETTINGS.get(getattr(config, "model_type", None))
    if needed is not None and getattr(config, needed[0], None) is None:
        name, what = needed
        raise ModelLoadError(f"architecture {architecture!r} needs {name!r} in its config.json: {what}")


# Layer kinds whose state is a softmax attention's keys and values, which the paged KV cache holds.
ATTENTION_LAYER_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
STATE_SPACE_ATTRIBUTES = ("state_size", "ssm_state_size", "mamba_d_state")


def check_not_a_draft_model(config: Any, architecture: str) -> None:
    """Raise UnsupportedModelError for a draft model that attends over another model's keys and
    values: served alone, it has none to attend over."""
    if (draft := NEEDS_A_TARGET_MODEL.get(getattr(config, "model_type", None))) is not None:
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported: it is {draft}")


def state_beside_keys_and_values(config: Any) -> str | None:
    """Why a model's layers keep state other than softmax attention's keys and values (state-space,
    linear or compressed attention, convolutions, differential attention), or None. The paged
    cache cannot hold that state, so such a model runs with transformers' own cache, kept per
    sequence between steps (`recompute_fallback.py`, `kept_states.py`)."""
    try:  # read apart from the rest: a heterogeneous config (Dots3) gives its layer kinds alone
        layer_types = getattr(config, "layer_types", None)
    except Exception:  # noqa: BLE001
        layer_types = None
    others = (
        sorted(set(layer_types or ()) - ATTENTION_LAYER_KINDS)
        if isinstance(layer_types, list | tuple)
        else []
    )
    try:
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
        state = [name for name in STATE_SPACE_ATTRIBUTES if getattr(config, name, None) is not None]
    except Exception:  # noqa: BLE001 - per-layer (heterogeneous) configs refuse global reads:
        heads, state = "per layer", []  # such a config is judged by its layer kinds alone
    if heads is None:
        return "it has no attention heads (a recurrent or state-space model)"
    if getattr(config, "model_type", None) in NOT_ONE_ATTENTION_A_LAYER:
        return f"its {NOT_ONE_ATTENTION_A_LAYER[config.model_type]} is not computed by the paged attention"
    if others:
        return f"its layers of kind {others} keep state that the paged KV cache does not hold"
    if state:
        return f"its state-space layers ({', '.join(state)}) keep state that the paged KV cache does not hold"
    return None
