"""What every shard of a model reads before it loads its weights: where the model is, its config,
device, dtype and context length; and the EOS ids its files state."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.device.selection import resolve_device, resolve_dtype
from tgserve.server.loading.language_model import language_model_config
from tgserve.server.loading.source import ModelSource, load_config, resolve_model

logger = logging.getLogger(__name__)


def config_max_len(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def eos_token_ids(config: Any, tokenizer: Any, source: ModelSource) -> frozenset[int]:
    """EOS ids from the generation config (which may list several), the model config and the tokenizer."""
    ids: set[int] = set()
    candidates: list[Any] = [getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    if source.gguf_file is None and (source.directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(source.directory).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


@dataclass(frozen=True)
class ModelDescription:
    """What every shard reads before it loads its weights."""

    source: ModelSource
    config: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int


def load_model_description(args: EngineArgs) -> ModelDescription:
    device = resolve_device(args.device)
    source = resolve_model(args.model, args.revision, args.allow_pickle)
    config = load_config(source, args.trust_remote_code)
    text = language_model_config(config, source)
    if text is not None:
        logger.info("%s is multimodal: its language model (%s) is served, for text", type(config).__name__,
                    text.architectures[0])  # fmt: skip
        config, source = text, replace(source, language_model_only=True)
    max_len = min(args.max_model_len or config_max_len(config), config_max_len(config))
    return ModelDescription(source, config, device, resolve_dtype(args.dtype, device), max_len)
