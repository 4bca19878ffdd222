"""The transformers fallback: any decoder-only HF architecture, attending through the engine's paged cache.

Models whose attention dispatches through transformers' `AttentionInterface` get tgserve's attention
function registered there: they read and write the paged cache like native models. The few that
bypass it (e.g. Falcon) call `past_key_values.update()` instead; for them a `PagedCacheAdapter`
writes the step's keys and values into the paged cache and hands back each sequence's gathered
context, with a block-diagonal causal mask over the concatenated contexts. Those that take no
cache at all are run over each whole sequence every step, as transformers generates with them
(`recompute_fallback.py`), and so are those whose layers keep state the paged cache cannot hold
(state-space, linear attention, convolutions: `registry.state_beside_keys_and_values`), with
their own attention and transformers' own cache kept per sequence between steps (`kept_states.py`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tgserve.server.attention.forward_context import get_forward_context, paged_attention
from tgserve.server.loading.errors import refuse_missing_weights
from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.models.fallback_linears import swap_in_kernel_linears
from tgserve.server.models.fallback_norms import swap_in_kernel_norms
from tgserve.server.models.fallback_rotary import kernel_rotary, swap_in_kernel_rotary
from tgserve.server.models.paged_cache_adapter import PagedCacheAdapter, packed_context_mask
from tgserve.server.models.recompute_fallback import RecomputingFallbackModel, is_recomputed
from tgserve.server.models.registry import state_beside_keys_and_values

logger = logging.getLogger(__name__)

ATTENTION_NAME = "tgserve_paged"
_registered = False


def _paged_attention_function(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers calls this in place of eager/sdpa attention; the batch is one flat sequence."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # The cache's head width; latent attention's values (and keys) may be narrower: zeros pad them,
    # which leaves the scores and the output's own columns as they are.
    width, value_dim = get_forward_context().specs[module.layer_idx].head_dim, value.shape[-1]
    q, k, v = (_padded(t[0], width).transpose(0, 1).contiguous() for t in (query, key, value))
    sinks = kwargs.get("s_aux")  # gpt-oss's learned sinks, a logit per query head
    out = paged_attention(module.layer_idx, q, k, v, scale, softcap, sinks=sinks)
    return out[..., :value_dim][None], None  # [1, T, H, D], as transformers' attention functions return


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The paged backend masks by itself (causal, per sequence, windows): transformers builds none."""
    return None


def register_attention() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention_function)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    _registered = True


def supports_attention_interface(model_class: type) -> bool:
    return bool(getattr(model_class, "_supports_attention_backend", False))


class TransformersFallbackModel(nn.Module):
    """Wraps an HF `*ForCausalLM` so that it takes the engine's flat batch and paged cache."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config
        self.uses_attention_interface = supports_attention_interface(type(hf_model))
        # transformers is renaming `past_key_values` to `cache` model by model.
        parameters = inspect.signature(hf_model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        # Some 4.x models (OPT and GPT-BigCode in 4.55, the Gaudi image's version) take no
        # `logits_to_keep` and return every position's logits; those rows are picked here instead.
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        backbone = getattr(hf_model, "transformer", None)
        if not self.uses_attention_interface and hasattr(backbone, "build_alibi_tensor"):
            backbone.build_alibi_tensor = _alibi_by_sequence(backbone.build_alibi_tensor)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"use_cache": False}
        if not self.uses_attention_interface:
            ctx = get_forward_context()
            kwargs = {
                "use_cache": True,
                self._cache_argument: PagedCacheAdapter(ctx),
                "attention_mask": packed_context_mask(ctx, dtype=self._dtype()),
            }
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = logits_indices
        with kernel_rotary():
            output = self.hf_model(input_ids=input_ids[None], position_ids=positions[None], **kwargs)
        logits = output.logits[0]
        return logits if self._takes_logits_to_keep else logits[logits_indices]

    def _dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype


def _alibi_by_sequence(build: Any) -> Any:
    """ALiBi (BLOOM) from each key's position in its own sequence. The model builds it from a 2D
    padding mask; this path's mask is the 4D one of several sequences' contexts packed together
    (`packed_context_mask`), so the biases come from the step's sequence lengths instead: the
    slopes are the model's own (its bias at position 1)."""

    def by_sequence(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        device = attention_mask.device
        lengths = get_forward_context().metadata.seq_lens_cpu
        positions = torch.cat([torch.arange(n, device=device) for n in lengths]).float()
        slopes = build(torch.ones(1, 2, device=device), num_heads, torch.float32)[:, 0, 1]
        return (slopes[:, None, None] * positions[None, None, :]).to(dtype)  # [heads, 1, keys]

    return by_sequence


def load_fallback_model(
    path: str,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    gguf_file: str | None,
    trust_remote_code: bool,
    fill_weights: Callable[[nn.Module], None] | None = None,
    key_mapping: dict[str, str] | None = None,
) -> TransformersFallbackModel | RecomputingFallbackModel:
    """Load the HF model with tgserve's attention, or as is for models that bypass the interface.

    With `fill_weights` (load_format "dummy") no checkpoint is read: the model is built from its
    config on the device and the function fills its weights, so any architecture can be benchmarked
    at its real shapes without writing weights first. `key_mapping`: checkpoint names to the
    model's (a multimodal checkpoint's language model, `loading/language_model.py`)."""
    register_attention()
    model_class = _causal_lm_class(config)
    stateful = state_beside_keys_and_values(config)
    if stateful is not None:  # run as transformers runs it, its attention included: by recomputation
        attention = None
    else:
        attention = ATTENTION_NAME if _class_supports_interface(config, trust_remote_code) else "eager"
    if fill_weights is None:
        mapped = {} if key_mapping is None else {"key_mapping": key_mapping}
        hf_model, loading = model_class.from_pretrained(
            path, config=config, gguf_file=gguf_file, trust_remote_code=trust_remote_code,
            attn_implementation=attention, output_loading_info=True, **dtype_kwargs(dtype), **mapped,
        )  # fmt: skip
        refuse_missing_weights(type(hf_model).__name__, path, loading["missing_keys"])
    else:
        with torch.device(device):
            hf_model = _built_from_config(model_class, config, trust_remote_code, attention, dtype)
        fill_weights(hf_model)
    refuse_unsupported_attention(hf_model, device)
    hf_model = hf_model.to(device).eval()
    swap_in_kernel_norms(hf_model, dtype)
    swap_in_kernel_linears(hf_model)
    swap_in_kernel_rotary(hf_model, dtype)
    if stateful is not None:
        logger.info("%s: %s; the paged cache keeps its token ids", type(hf_model).__name__, stateful)
        return RecomputingFallbackModel(hf_model, keep_state=True)
    if not supports_attention_interface(type(hf_model)) and is_recomputed(type(hf_model), config.model_type):
        return RecomputingFallbackModel(hf_model)
    return TransformersFallbackModel(hf_model)


def _causal_lm_class(config: Any) -> Any:
    """AutoModelForCausalLM, or where its mapping has no entry for the config's class the class the
    config names (a multimodal checkpoint's text model that transformers registers under the
    composite type only, such as Mllama's `MllamaForCausalLM`)."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or not getattr(config, "architectures", None):
        return AutoModelForCausalLM
    named = getattr(transformers, config.architectures[0], None)
    return AutoModelForCausalLM if named is None else named


def _built_from_config(
    model_class: Any, config: Any, trust_remote_code: bool, attention: str | None, dtype: torch.dtype
) -> nn.Module:
    """The model of `config` with no weights read. A named class has no public `from_config`: the
    auto classes' calls its `_from_config`, as here."""
    from transformers import AutoModelForCausalLM

    if model_class is AutoModelForCausalLM:
        return AutoModelForCausalLM.from_config(
            config, trust_remote_code=trust_remote_code, attn_implementation=attention, **dtype_kwargs(dtype)
        )
    return model_class._from_config(config, attn_implementation=attention, **dtype_kwargs(dtype))


def refuse_unsupported_attention(hf_model: nn.Module, device: torch.device) -> None:
    """Raise UnsupportedModelError for attention a device's paged kernels do not compute, rather
    than serve wrong tokens: learned attention sinks (gpt-oss's `sinks`, passed to the attention
    function as `s_aux`, a share of every softmax) are computed by the CPU and CUDA backends, not
    by the Gaudi one."""
    from tgserve.server.models.registry import UnsupportedModelError

    if torch.device(device).type in ("cpu", "cuda"):
        return
    for name, _ in hf_model.named_parameters():
        if name.rsplit(".", 1)[-1] == "sinks":
            raise UnsupportedModelError(
                f"{type(hf_model).__name__}: attention with learned sinks ({name}) runs on the CPU and "
                f"CUDA backends only so far; the {torch.device(device).type} attention would leave the sinks "
                "out and give wrong tokens"
            )


def _class_supports_interface(config: Any, trust_remote_code: bool) -> bool:
    """Whether the registered transformers class dispatches attention through `AttentionInterface`.

    Remote-code models are assumed to (recent ones do); loading fails clearly if one does not.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return True
    if isinstance(model_class, (list, tuple)):
        model_class = model_class[0]
    return supports_attention_interface(model_class)
