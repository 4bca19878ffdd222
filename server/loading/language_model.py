"""Multimodal checkpoints served for text: their language model alone.

Gemma 3 (4B and up), Mistral Small 3.1, Llama 4, Qwen3.5 and others ship as image-text-to-text
models: a config whose `text_config` describes the language model, and a vision tower beside it.
tgserve generates text from text, so it serves the language model: the text config, under the
causal-LM class transformers names for its type (native where tgserve has one), and the
checkpoint's language-model weights under that class's names. The vision tower's tensors are not
read. Requests with image content are refused by the router, as for any model.

Where a multimodal config has no text config of its own (Phi-4-multimodal, GIT: the language
model's settings at its top level, beside its towers' configs), there is nothing to separate: the
checkpoint's causal-LM class is served whole, its towers loaded and never run.

Checkpoints name the language model's weights `language_model.model.*` (Gemma 3, Mistral 3,
Llama 4, as published), `model.language_model.*` (transformers 5's layout, Qwen3.5) or
`text_model.model.*` (Emu3); the head is `language_model.lm_head.*`, `text_model.lm_head.*` or
`lm_head.*`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from tgserve.server.loading.errors import ModelLoadError
from tgserve.server.loading.source import ModelSource

# Checkpoint prefix -> the text causal LM's, in the order tried.
LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("text_model.model.", "model."),  # Emu3
    ("language_model.lm_head.", "lm_head."),
    ("text_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
# Settings a composite config may state at its top level for its language model.
SHARED_SETTINGS = ("tie_word_embeddings", "quantization_config")


def language_model_config(config: Any, source: ModelSource) -> Any | None:
    """The language model's config of a multimodal checkpoint (one published as a multimodal class,
    `is_multimodal_class`), its `architectures` the causal-LM class transformers names for its
    type; None for any other (a text model, a GGUF file, or a causal LM of a composite config such
    as a draft model, which the registry judges as it is)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    get_text_config = getattr(config, "get_text_config", None)
    if source.gguf_file is not None or get_text_config is None:
        return None
    text = get_text_config()
    published = (
        getattr(config, "architectures", None) or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)]
    )[0]
    if text is config or text is None or not is_multimodal_class(published):
        return None
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.model_type) or _text_class_of(config, text)
    if causal is None:
        raise ModelLoadError(
            f"{published} is a multimodal model whose language model ({text.model_type!r}) transformers has "
            "no causal-LM class for; it cannot be served for text alone"
        )
    text.architectures = [causal]
    stated = json.loads((source.directory / "config.json").read_text())
    for name in SHARED_SETTINGS:
        if name in stated:
            setattr(text, name, stated[name])
    return text


def is_multimodal_class(name: str | None) -> bool:
    """Whether transformers' class `name` is a multimodal one (image-text-to-text, or a conditional
    generation class over a composite config), whose language model is served for text."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return bool(name) and (
        name.endswith("ForConditionalGeneration")
        or name in set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())
    )


def _text_class_of(config: Any, text: Any) -> str | None:
    """The causal-LM class transformers maps the composite type to, where it is built from the text
    config (Mllama's `MllamaForCausalLM`); else None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    model_class = getattr(transformers, name, None) if name else None
    return name if model_class is not None and model_class.config_class is type(text) else None


def is_language_model_weight(name: str) -> bool:
    return name.startswith(tuple(prefix for prefix, _ in LANGUAGE_MODEL_PREFIXES))


def language_model_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The language model's (name, tensor) pairs of a multimodal checkpoint under the text causal
    LM's names; every other tensor (vision tower, projector) left out."""
    for name, tensor in weights:
        for prefix, target in LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                yield target + name[len(prefix) :], tensor
                break


def language_model_key_mapping() -> dict[str, str]:
    """The same renames for transformers' `from_pretrained(key_mapping=...)` (the fallback's and
    optimum-habana's loads); the vision tower's keys stay unexpected, and are not loaded."""
    return {f"^{re.escape(prefix)}": target for prefix, target in LANGUAGE_MODEL_PREFIXES if prefix != target}
