"""SmolLM2-135M-Instruct as a float32 safetensors checkpoint, converted once from the shipped GGUF.

Reading the GGUF dequantises every tensor in Python (tens of seconds); tests that need the real
model many times load this converted copy instead. Tests of the GGUF path itself use the GGUF.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.loading.gguf_parsing import parsed_once
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.loading.source import ModelSource, load_tokenizer
from tgserve.server.testing.fixtures import _publish_atomically, default_cache_dir


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """A directory with config, tokenizer and model.safetensors, built on first use and cached."""
    import transformers

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"smollm2-135m-instruct-tf{transformers.__version__}"
    if target.is_dir():
        return target
    return _publish_atomically(target, _convert)


@parsed_once()  # the weights and the tokenizer from one parse of the file
def _convert(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = default_model_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, **dtype_kwargs(torch.float32)
    )
    # The weights are already dequantised; drop the GGUF marker (transformers 5 records one, 4.55
    # does not) so that transformers saves them as they are.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    fresh = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32))
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(out, safe_serialization=True)
    load_tokenizer(ModelSource(gguf.parent, gguf.name)).save_pretrained(out)
