"""The one place that chooses the engine for a model: `LLMEngine`, or the optimum-habana fallback."""

from __future__ import annotations

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.interface import Engine
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.description import load_model_description
from tgserve.server.loading.gguf_parsing import parsed_once
from tgserve.server.optimum_habana.engine import StaticBatchEngine
from tgserve.server.optimum_habana.fallback_model import fallback_needed


def create_engine(args: EngineArgs) -> Engine:
    """The engine for `args`: `LLMEngine`, or on a Gaudi, for an architecture with no native
    implementation, optimum-habana's static-cache model behind the same interface."""
    with parsed_once():  # a GGUF file's config, tokenizer and weights from one parse
        described = load_model_description(args)
        if fallback_needed(described.config, described.device):
            return StaticBatchEngine(args, described)
        return LLMEngine(args, described)
