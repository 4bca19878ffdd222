"""Differences between the transformers versions tgserve supports, each decided once here.

Development and CI run transformers 5.x; the Gaudi image runs optimum-habana 1.21, which pins
transformers 4.55, so everything the Gaudi path touches must work on both (`make test-compat` runs
the parity tests on 4.55). Code elsewhere asks this module instead of checking versions itself.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=1)
def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers."""
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """The keyword that sets the dtype in `from_pretrained` / `from_config`.

    4.56 renamed `torch_dtype` to `dtype`; 5.x warns on `torch_dtype`, and 4.55 passes an unknown
    `dtype` on to the model's constructor, which fails.
    """
    return {"dtype" if transformers_version() >= (4, 56) else "torch_dtype": dtype}


def set_config_dtype(config: Any, dtype: str) -> None:
    """Record the checkpoint dtype in a config, under the attribute this version saves to config.json.

    4.56 renamed the config's `torch_dtype` to `dtype` (5.x keeps `torch_dtype` as a deprecated alias);
    on 4.55 a `dtype` attribute would be saved as an unknown extra key and `torch_dtype` left empty.
    """
    setattr(config, "dtype" if transformers_version() >= (4, 56) else "torch_dtype", dtype)


def empty_cache_init_kwargs() -> dict[str, Any]:
    """`Cache.__init__` arguments for a cache subclass that keeps no per-layer state of its own.

    Later versions (4.57, 5.x) build a `Cache` from a list of `layers`; 4.55 from `layer_classes`, of
    which it makes one layer when given no config (never used by such a subclass). Decided by the
    signature rather than a version number, as the change came between the two.
    """
    import inspect

    from transformers.cache_utils import Cache

    if "layers" in inspect.signature(Cache.__init__).parameters:
        return {"layers": []}
    from transformers.cache_utils import DynamicLayer

    return {"layer_classes": DynamicLayer}


def fix_gguf_tokenizer(tokenizer: Any, gguf_path: Path) -> None:
    """Give a tokenizer read from a GGUF file the special tokens and BOS rule the file states.

    transformers 4.x (4.55 in the Gaudi image, still so in 4.57) builds a llama-architecture GGUF's
    tokenizer with its BOS token as the EOS token too, no padding token, and a BOS added to every
    encoding whatever the file's `tokenizer.ggml.add_bos_token` says (SmolLM2's says false, so its
    chat prompts would start with a second `<|im_start|>`). 5.x reads all of them from the file.
    """
    if transformers_version() >= (5, 0):
        return
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def scalar(key: str) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None or not field.data else field.parts[field.data[0]].tolist()[0]

    for attribute, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = scalar(key)
        if token_id is not None and token_id < len(tokenizer):
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))
    for attribute in ("add_bos_token", "add_eos_token"):
        value = scalar(attribute)
        # A property on the tokenizers that rebuild their post-processor when it is set (Llama's).
        if value is not None and isinstance(getattr(type(tokenizer), attribute, None), property):
            setattr(tokenizer, attribute, bool(value))


@functools.lru_cache(maxsize=64)
def checkpoint_renames(model_type: str) -> tuple[tuple[re.Pattern[str], str], ...]:
    """The renames transformers applies to a model type's checkpoint names as it loads them (5.x's
    `conversion_mapping`: EXAONE's `transformer.h.N.attn.attention.*` are Llama's
    `model.layers.N.self_attn.*`), as (pattern, replacement) in order; none on 4.55, which has no
    such mapping (its model classes carry the checkpoints' own names). Conversions beyond renaming
    (merged experts, split tensors) are not included: a native model that needed them would name
    the weights it cannot place."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping
    except ImportError:
        return ()
    renames = []
    for transform in get_checkpoint_conversion_mapping(model_type) or ():
        if isinstance(transform, WeightRenaming):
            renames.extend(
                (re.compile(source), target)
                for source, target in zip(transform.source_patterns, transform.target_patterns, strict=True)
            )
    return tuple(renames)


def renamed_checkpoint_weights(
    weights: Iterable[tuple[str, Any]], model_type: str
) -> Iterator[tuple[str, Any]]:
    """`weights` ((name, tensor) pairs) under the names transformers gives them (`checkpoint_renames`)."""
    renames = checkpoint_renames(model_type)
    for name, tensor in weights:
        for pattern, target in renames:
            name = pattern.sub(target, name)
        yield name, tensor
