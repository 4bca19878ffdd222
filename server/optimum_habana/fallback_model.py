"""The model boundary of the optimum-habana fallback, and when a Gaudi needs that fallback.

On a Gaudi, an architecture with no native tgserve implementation runs as optimum-habana's Gaudi class
(`adapt_transformers_to_gaudi()` swaps transformers' classes for them in place, so the ordinary
`AutoModelForCausalLM` then builds the Gaudi one), with its own static cache served by
`StaticBatchEngine`. Anywhere else (the CPU, in tests) the same call builds the plain transformers
class, which takes the same inputs. optimum-habana and the Habana bridge are imported only on an hpu
device, when a model is loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tgserve.server.loading.errors import ModelLoadError, refuse_missing_weights
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.loading.language_model import language_model_key_mapping
from tgserve.server.loading.source import ModelSource, safetensors_files, verify_safetensors
from tgserve.server.models.registry import architecture_name, native_model_class


def fallback_needed(config: Any, device: torch.device | str) -> bool:
    """True when `config`'s model must be served through optimum-habana on `device`.

    That is on an hpu device, for every architecture without a native tgserve implementation, or
    whose implementation does not run there (`runs_on_hpu` False: the mixtures of experts, whose
    routing decides per step which expert weights are read, which a recorded HPU graph cannot
    follow; optimum-habana has Gaudi MoE ops for them): the native families run on the paged hpu
    backend through `LLMEngine`; everything else goes to `StaticBatchEngine`. Off a Gaudi, never (the transformers fallback serves those architectures).
    """
    if torch.device(device).type != "hpu":
        return False
    native = native_model_class(architecture_name(config), config)
    return native is None or not getattr(native, "runs_on_hpu", True)


def load_fallback_model(
    source: ModelSource,
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> nn.Module:
    """The causal LM of `source` in eval mode on `device`: optimum-habana's Gaudi class on an hpu
    device, the plain transformers class elsewhere."""
    device = torch.device(device)
    if device.type == "hpu":
        _adapt_transformers_to_gaudi()
    if source.gguf_file is None:
        # Refuse pickle-only checkpoints and name corrupt files before transformers sees them.
        verify_safetensors(safetensors_files(source, allow_pickle))
    from transformers import AutoModelForCausalLM

    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            source.directory,
            config=config,
            gguf_file=source.gguf_file,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **dtype_kwargs(dtype),
            **({"key_mapping": language_model_key_mapping()} if source.language_model_only else {}),
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {source.display_name} through transformers: {exc}") from exc
    refuse_missing_weights(type(model).__name__, source.display_name, loading["missing_keys"])
    return model.eval().to(device)


def _adapt_transformers_to_gaudi() -> None:
    """Load the Habana bridge (it registers the hpu device) and swap in optimum-habana's classes."""
    import habana_frameworks.torch.core  # noqa: F401
    from optimum.habana.transformers.modeling_utils import adapt_transformers_to_gaudi

    adapt_transformers_to_gaudi()
