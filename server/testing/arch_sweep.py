"""The architecture sweep: every causal-LM architecture the installed transformers knows, built tiny
and random from its own config class, run through the engine beside transformers' `generate`.

    python -m tgserve.server.testing.arch_sweep [--only llama,gpt2] [--out docs/architectures.md]

For each (model_type, class) of transformers' causal-LM auto mapping: a config from
`AutoConfig.for_model` with the common size names set small (hidden 64, 2 layers, 4 heads of 16,
2 KV heads, MoE with 4 experts routed top-2, the shared tokenizer's vocabulary), refused by name
where the engine does not serve such models (encoder-decoder, multimodal, too large once shrunk);
random weights (seeded, float32) saved as a checkpoint; greedy tokens of two prompts from transformers
`generate` and from the engine (CPU, float32, chunked prefill, a prefix-cache hit), compared token
for token. Each architecture runs in a process of its own, bounded in time, so one that crashes or
hangs is a row of the table, not the end of the sweep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NEW_TOKENS = 8
MAX_PARAMETERS = 5_000_000  # a config the size names did not shrink is refused, not built
SIZES: dict[str, Any] = {
    # Llama-style names, then the older families' aliases (set only where the config has them).
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "n_positions": 512, "n_ctx": 512,
    "d_model": 64, "num_layers": 2, "ffn_dim": 128, "decoder_layers": 2, "decoder_attention_heads": 4,
    "decoder_ffn_dim": 128, "moe_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "shared_expert_intermediate_size": 64,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "sliding_window": 16, "n_group": 1, "topk_group": 1,
    # RoCBert's glyph-shape and pronunciation embeddings (25K and 910 ids, 512 and 768 wide by default).
    "shape_embed_dim": 16, "shape_vocab_size": 64, "pronunciation_embed_dim": 16, "pronunciation_vocab_size": 64,
    # Inkling 2's sliding-window layers name their own heads and window.
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16, "sliding_window_size": 16,
}  # fmt: skip
MULTIMODAL = "multimodal (sub-configs)"
MULTIMODAL_PARTS = ("vision_config", "audio_config", "text_config", "speech_config", "encoder_config")
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Settings a model type's released checkpoints give (or, for X-MOD, its users must give) and its
# config class's defaults do not, so that transformers itself cannot build or run the default (the
# sweep's "untested" rows).
CHECKPOINT_SETTINGS: dict[str, dict[str, Any]] = {
    # A RoPE per layer type, as Cohere's other hybrid-window models give.
    "cohere_compass_text": {"rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    # DBRX's attention and expert configs, which the size names do not reach: KV heads, RoPE base
    # and the query/key/value clip (8 in DBRX-Instruct); the experts' sizes, two of four a token.
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"hidden_size": 64, "ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # Reformer's axial position embeddings: their two widths must sum to the hidden size.
    "reformer": {"axial_pos_embds_dim": [16, 48]},
    # LFM2-MoE's layer kinds: short convolutions among attention layers.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Hybrids: one layer of each kind in the two, as their checkpoints interleave them (with the
    # defaults' kinds at two layers, transformers' own cache has no attention layer and fails).
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16},
    "granitemoehybrid": {
        "layer_types": ["linear_attention", "full_attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
    },
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Zamba's shared attention block is tied across its hybrid layers: two of them, a Mamba layer between.
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["hybrid", "linear_attention", "hybrid"],
        "attention_head_dim": 16,
        "n_mamba_heads": 2,
    },
    "zamba2": {
        "layers_block_type": ["linear_attention", "hybrid"],
        "hybrid_layer_ids": [1],
        "attention_head_dim": 32,
        "n_mamba_heads": 4,
        "mamba_headdim": 32,
    },
    "qwen4_exp_text": {
        "layer_types": ["linear_attention", "indexed_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # Mamba-2's heads must tile its inner width (hidden x expand); ZAYA routes each token to one expert.
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "zaya": {"num_experts_per_tok": 1},
    # DeepSeek-style indexed (sparse) attention: an indexer of the other heads' size; latent attention
    # with a key and value head a query head, as transformers computes it.
    "deepseek_v32": {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "num_key_value_heads": 4},
    "axk2": {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "num_key_value_heads": 4},
    "glm_moe_dsa": {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "num_key_value_heads": 4},
    # dots.llm3's sliding layers name their own latent attention's sizes (`swa_*`, set nowhere else),
    # a key and value head a query head as in its indexed layers.
    "dots3_note_text": {
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_head_dim": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 16,
        "swa_q_lora_rank": 32,
        "swa_kv_lora_rank": 16,
    },
    # Dory's layers run as input, recurrent (looped) and output stacks: two layers each, the
    # recurrent ones looped twice as its checkpoints loop them.
    "dory": {
        "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
        "num_hidden_layers": 6,
        "n_input_layers": 2,
        "n_recurrent_layers": 2,
        "n_output_layers": 2,
    },
    # xLSTM: transformers' own cached generate fails at these sizes with the default half-width
    # queries and keys ("matC_old has wrong shape": its step state takes the values' width); keys as
    # wide as values run.
    "xlstm": {"num_heads": 4, "qk_dim_factor": 1.0},
    # X-MOD's language adapters: the one a request without language ids runs through (its model card
    # has users call `set_default_language`; the config's `default_language` sets the same).
    "xmod": {"default_language": "en_XX"},
}


@dataclass
class Row:
    """One architecture's outcome: exact, differs, refused (why), failed (the engine's error), or
    untested (transformers itself could not build or generate with the tiny config)."""

    model_type: str
    architecture: str
    status: str
    detail: str = ""
    seconds: float = 0.0


def causal_lm_architectures() -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def tiny_config(model_type: str, ids: Any, **overrides: Any) -> Any:
    """The model type's config with the size names it has set small (then `overrides`, given to the
    config class with them: per-layer settings are derived as it is built); raises Refused where
    the engine does not serve such a model."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    if getattr(default, "is_encoder_decoder", False):
        raise Refused("encoder-decoder")
    if any(getattr(default, part, None) is not None for part in MULTIMODAL_PARTS):
        raise Refused(MULTIMODAL)
    # BERT-style configs default to the encoder (bidirectional attention over the prompt); as a causal
    # LM such a model is a decoder, as checkpoints trained for generation say.
    decoder = {"is_decoder": True} if hasattr(default, "is_decoder") else {}
    return AutoConfig.for_model(
        model_type, **(text_sizes(default, ids) | decoder | ids.as_kwargs() | overrides)
    )


def text_sizes(default: Any, ids: Any) -> dict[str, Any]:
    """The size names a language model's config has, set small (`SIZES`, kept consistent)."""
    settable = [name for name in SIZES if not isinstance(getattr(type(default), name, None), property)]
    sizes = {name: SIZES[name] for name in settable if _has(default, name)}
    sizes |= consistent_sizes(default, sizes) | per_layer_inputs(default, ids.vocab_size)
    if "unpadded_vocab_size" in vars(default):  # Inkling 2's LM head: the vocabulary before padding
        sizes["unpadded_vocab_size"] = ids.vocab_size
    return sizes


# A vision or audio tower's sizes, which text generation never runs: as small as its config takes.
TOWER_SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1,
                "num_attention_heads": 2, "num_heads": 2, "downsample_hidden_size": 16,
                # Emu3's image tokenizer (a VQ-GAN): a small codebook, one narrow level.
                "codebook_size": 32, "base_channels": 32, "channel_multiplier": [1], "num_res_blocks": 1,
                # Phi-4-multimodal's speech encoder: its convolutions' channels.
                "nemo_conv_channels": 32, "ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32}  # fmt: skip
TOWERS = ("vision_config", "audio_config", "vq_config")


def tiny_multimodal_config(model_type: str, ids: Any) -> Any:
    """A multimodal model type's config with a tiny language model and its vision and audio towers
    at one small layer. The language model is `tiny_config` of its text config's type, or where the
    type has none (Phi-4-multimodal, GIT: the language model's settings at the top level, beside the
    towers' configs) those settings set small. The engine serves the language model; for the
    second kind, the model's class whole, its towers loaded and never run."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    text_type = default.get_text_config().model_type if hasattr(default, "get_text_config") else model_type
    if text_type == model_type:
        if not any(getattr(default, part, None) is not None for part in TOWERS):  # BLT's byte-level parts
            parts = [part for part in MULTIMODAL_PARTS if getattr(default, part, None) is not None]
            raise Refused(f"sub-models that are not a vision or audio tower ({', '.join(parts)}): not shrunk")
        text = text_sizes(default, ids) | CHECKPOINT_SETTINGS.get(model_type, {})
        towers = shrunk_towers(default, text.get("hidden_size", SIZES["hidden_size"]))
        return AutoConfig.for_model(model_type, **(text | towers | ids.as_kwargs()))
    text = tiny_config(text_type, ids, **CHECKPOINT_SETTINGS.get(text_type, {}))
    towers = shrunk_towers(default, text.hidden_size)
    return AutoConfig.for_model(
        model_type, text_config=text.to_dict(), **towers, **image_vocabulary(default, ids), **ids.as_kwargs()
    )


def shrunk_towers(default: Any, text_hidden: int) -> dict[str, dict[str, Any]]:
    """The config's vision, audio and image-tokenizer configs at `TOWER_SIZES`, their projections
    into the language model `text_hidden` wide."""
    towers = {}
    for part in TOWERS:
        if getattr(default, part, None) is not None:
            sizes = getattr(default, part).to_dict()
            sizes |= {name: value for name, value in TOWER_SIZES.items() if name in sizes}
            sizes |= {
                name: text_hidden for name in ("out_hidden_size", "projector_output_dim") if name in sizes
            }
            sizes |= {name: 32 for name in ("vision_output_dim", "projector_input_dim") if name in sizes}
            sizes |= tower_adapters(sizes, text_hidden)
            towers[part] = sizes
    return towers


def image_vocabulary(default: Any, ids: Any) -> dict[str, Any]:
    """Emu3's map of its image tokens, which its checkpoints give and its model needs to be built:
    the last ids of the vocabulary (an image start, its end-of-line marker, four visual tokens)."""
    if "vocabulary_map" not in vars(default) or default.vocabulary_map is not None:
        return {}
    last = ids.vocab_size - 1
    names = ["<image>", "<|extra_200|>"] + [f"<|visual token {i:06d}|>" for i in range(4)]
    return {"vocabulary_map": {name: last - len(names) + 1 + i for i, name in enumerate(names)}}


def tower_adapters(sizes: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """A shrunk tower's settings that must agree with its new width and depth (dots.llm3's): the
    adapter's input is the tower's width, its output the language model's; per-layer lists and
    settings cut to the tower's layers."""
    width, layers = sizes.get("hidden_size"), sizes.get("num_hidden_layers")
    agreed = {name: width for name in ("adapter_in_dim", "adapter_input_size") if name in sizes}
    agreed |= {"adapter_out_dim": text_hidden} if "adapter_out_dim" in sizes else {}
    if layers is not None:
        agreed |= {
            name: value[:layers]
            for name, value in sizes.items()
            if name.endswith("layer_types") and isinstance(value, list)
        }
        if sizes.get("per_layer_config"):
            agreed["per_layer_config"] = {
                k: v for k, v in sizes["per_layer_config"].items() if int(k) < layers
            }
    return agreed


def saved_tiny_model(model_type: str, architecture: str, directory: Path, **overrides: Any) -> Any:
    """A tiny random transformers model of the type (`tiny_config`, then `overrides` set on its
    config), saved with the fixtures' tokenizer into `directory`; float32, its norms' weights
    randomized (they start at a constant, Gemma's at zero, where a mistake would not show)."""
    from tgserve.server.testing.fixtures import _token_ids, _tokenizer_dir, default_cache_dir

    tokenizer_dir = _tokenizer_dir(default_cache_dir())
    config = tiny_config(model_type, _token_ids(tokenizer_dir))
    for name, value in overrides.items():
        setattr(config, name, value)
        if name.endswith("layer_types"):  # a per-layer list given whole says how many layers there are
            config.num_hidden_layers = len(value)
    return saved_random_model(config, architecture, directory, tokenizer_dir)


def saved_tiny_multimodal_model(model_type: str, architecture: str, directory: Path) -> Any:
    """`saved_tiny_model` for a multimodal type (`tiny_multimodal_config`), as its checkpoints are
    published (`architecture`: the image-text-to-text class)."""
    from tgserve.server.testing.fixtures import _token_ids, _tokenizer_dir, default_cache_dir

    tokenizer_dir = _tokenizer_dir(default_cache_dir())
    config = tiny_multimodal_config(model_type, _token_ids(tokenizer_dir))
    return saved_random_model(config, architecture, directory, tokenizer_dir)


def saved_random_model(config: Any, architecture: str, directory: Path, tokenizer_dir: Path) -> Any:
    """The transformers class `architecture` of `config`, random (seeded), float32, its norms'
    weights randomized too, saved with the tokenizer files of `tokenizer_dir` into `directory`."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(directory)
    copy_tokenizer(tokenizer_dir, directory)
    return model


def copy_tokenizer(tokenizer_dir: Path, directory: Path) -> None:
    """The fixtures' shared tokenizer files beside a model saved in `directory`."""
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)


def _has(config: Any, name: str) -> bool:
    """Whether the config has the attribute; a per-layer attribute of a heterogeneous config
    (transformers 5, Gemma 4's head_dim) has one, though reading it globally raises."""
    try:
        return hasattr(config, name)
    except RuntimeError:
        return name in (getattr(config, "per_layer_attributes", None) or ())


def per_layer_inputs(default: Any, vocab_size: int) -> dict[str, Any]:
    """Gemma 3n's and Gemma 4's per-layer input embeddings (a table of vocabulary x layers x width)
    over the tokenizer's vocabulary at a width of 8; their wider full-attention heads (Gemma 4's
    `global_head_dim`, a per-layer head_dim) twice the common head size, so that they still differ."""
    sizes: dict[str, Any] = {}
    if vars(default).get("hidden_size_per_layer_input"):
        sizes |= {"vocab_size_per_layer_input": vocab_size, "hidden_size_per_layer_input": 8}
    if "head_dim" in (getattr(default, "per_layer_attributes", None) or ()):
        sizes["global_head_dim"] = 2 * SIZES["head_dim"]
    return sizes


def consistent_sizes(default: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """Sizes that depend on others, which the common names alone would leave inconsistent."""
    derived: dict[str, Any] = {}
    if "qk_rope_head_dim" in sizes and "head_dim" in sizes:
        # Latent-attention configs (DeepSeek-V3 and its kin) rotate `head_dim` channels: the rotary part.
        derived["head_dim"] = sizes["qk_rope_head_dim"]
    if isinstance(getattr(default, "rotary_dim", None), int):
        derived["rotary_dim"] = 8  # GPT-J / CodeGen: rotary channels of a 16-wide head
    if "index_head_dim" in vars(default):  # DeepSeek sparse attention's indexer
        derived |= {"index_head_dim": 16, "index_n_heads": 2}
    if "attention_types" in vars(default):  # GPT-Neo: [[kinds, repeats]] spelling its layers out
        derived["attention_types"] = [[["global", "local"], 1]]
    if "num_hidden_layers" in sizes:
        derived |= shrunk_layer_lists(default)
        derived |= shared_kv_layers(default, derived)
    return derived


def shared_kv_layers(default: Any, shrunk: dict[str, Any]) -> dict[str, Any]:
    """Where the last layers reuse earlier layers' keys and values (Gemma 3n's, Gemma 4's
    `num_kv_shared_layers`): the shrunk layers twice over, the second time sharing, so that every
    kind of sharing layer has a layer of its kind to share from."""
    kinds = shrunk.get("layer_types")
    if not vars(default).get("num_kv_shared_layers") or kinds is None:
        return {}
    doubled = {name: value + value for name, value in shrunk.items() if name.endswith("layer_types")}
    return doubled | {"num_hidden_layers": 2 * len(kinds), "num_kv_shared_layers": len(kinds)}


def shrunk_layer_lists(default: Any) -> dict[str, Any]:
    """Per-layer lists (`layer_types`, `mlp_layer_types`, ...) cut to the first layer of each kind
    that occurs (at least two layers), so that a tiny model still has every kind of layer: two
    layers of a five-to-one sliding/full pattern would test no full-attention layer at all."""
    count = getattr(default, "num_hidden_layers", None)
    lists = {
        name: value
        for name, value in vars(default).items()
        if name.endswith("layer_types") and isinstance(value, list | tuple) and len(value) == count
    }
    if not lists:
        return {}
    rows = list(zip(*lists.values(), strict=True))
    keep = sorted({row: i for i, row in reversed(list(enumerate(rows)))}.values())
    if len(keep) < 2:  # one kind of layer: the first two, as the common sizes give
        keep = list(range(min(2, len(rows))))
    return {"num_hidden_layers": len(keep)} | {
        name: [value[i] for i in keep] for name, value in lists.items()
    }


class Refused(Exception):
    """An architecture the engine does not serve, and why."""


def run_one(model_type: str, architecture: str, workdir: Path, **overrides: Any) -> Row:
    """Build (`tiny_config`, with the type's checkpoint settings and `overrides`), save, generate
    both ways, compare (in this process)."""
    overrides = CHECKPOINT_SETTINGS.get(model_type, {}) | overrides
    import transformers

    from tgserve.server.engine.llm import LLM
    from tgserve.server.protocol.params import SamplingParams
    from tgserve.server.testing.fixtures import _token_ids, _tokenizer_dir, default_cache_dir

    start = time.perf_counter()
    tokenizer_dir = _tokenizer_dir(default_cache_dir())  # the fixtures' shared tokenizer
    if why := engine_refusal(model_type, architecture):  # by its type alone: its config may not even build
        return Row(model_type, architecture, "refused", why)
    try:
        config = _tiny_config_or_multimodal(model_type, _token_ids(tokenizer_dir), **overrides)
    except Refused as why:
        return Row(model_type, architecture, "refused", str(why))
    except Exception as exc:  # the config class rejects the small sizes: the sweep's, not the engine's
        return Row(model_type, architecture, "untested", f"config: {type(exc).__name__}: {exc}"[:300])
    model_class = getattr(transformers, _published_class(config, architecture))
    directory = workdir / model_type

    def untested(exc: Exception) -> Row:  # transformers fails on the tiny model too: not the engine's
        return Row(model_type, architecture, "untested", f"transformers: {type(exc).__name__}: {exc}"[:300])

    prompts = [
        [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
        [5, 6, 7, 8, 9, 10, 11, 12, 30, 31],
    ]
    against = ""
    try:
        model = saved_published_model(model_class, config, directory)
    except Refused as why:
        return Row(model_type, architecture, "refused", str(why))
    except ImportError as exc:
        # A tower needs a library this environment lacks (Gemma 3n's vision tower: timm). The engine
        # never builds the towers, so the checkpoint can hold the language model alone.
        if not _language_model_only(config):
            return untested(exc)
        model = saved_language_model_alone(config, model_class.__name__, directory)
        against = "a checkpoint of its language model alone (its towers need a library not installed here)"
    except Exception as exc:
        return untested(exc)
    try:
        want = greedy_reference(model, prompts)
    except Exception as exc:
        if not _language_model_only(config):
            return untested(exc)
        # Llama 4's composite class cannot generate from text alone (transformers 5.24: its output
        # has no `image_outputs`); its language model's class over the same weights can.
        model = text_class_model(directory)
        want = greedy_reference(model, prompts)
        against = f"against {type(model).__name__} ({type(exc).__name__} from the published class's generate)"
    copy_tokenizer(tokenizer_dir, directory)
    from tgserve.server.models.registry import UnsupportedModelError

    try:
        llm = LLM(
            str(directory),
            dtype="float32",
            device="cpu",
            max_num_batched_tokens=8,
            block_size=8,
            num_blocks=64,
        )
    except UnsupportedModelError as why:  # the engine refuses it by name
        return Row(model_type, architecture, "refused", str(why)[:300])
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    got = [
        llm.generate([p], params)[0].token_ids for p in prompts
    ]  # one at a time: the second hits the first's blocks
    seconds = time.perf_counter() - start
    if got == want:
        served = [_language_model_only(config), against, _recomputation(llm.engine.shard.forward.model)]
        return Row(model_type, architecture, "exact", "; ".join(part for part in served if part), seconds)
    if got == [uncached_greedy(model, prompt) for prompt in prompts]:
        note = "transformers' cached `generate` differs from its own uncached forward; the engine equals the latter"
        return Row(model_type, architecture, "exact", f"{note}: generate gave {want}", seconds)
    return Row(model_type, architecture, "differs", f"engine {got} vs transformers {want}", seconds)


def saved_published_model(model_class: Any, config: Any, directory: Path) -> Any:
    """The tiny model of the published class, random (seed 0), float32, saved in `directory`;
    Refused where the size names left it larger than MAX_PARAMETERS."""
    import torch

    with torch.device("meta"):
        count = sum(p.numel() for p in model_class(config).parameters())
    if count > MAX_PARAMETERS:
        raise Refused(f"not shrunk by the common size names ({count:,} parameters)")
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    model.save_pretrained(directory)
    return model


def saved_language_model_alone(config: Any, published: str, directory: Path) -> Any:
    """A multimodal checkpoint whose towers cannot be built here: its language model alone (the
    causal-LM class of its text config, random, seed 0), saved under the composite's names
    (`model.language_model.*`, `lm_head.*`) beside the composite's config."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = config.get_text_config()
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text.model_type])(text).float().eval()
    tied = model.config.tie_word_embeddings
    weights = {
        name.replace("model.", "model.language_model.", 1): tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config.architectures = [published]
    config.save_pretrained(directory)
    return model


def greedy_reference(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy `generate`, NEW_TOKENS new tokens for each prompt."""
    import torch

    want = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, pad_token_id=model.config.pad_token_id)  # fmt: skip
        want.append(out[0, len(prompt) :].tolist())
    return want


def text_class_model(directory: Path) -> Any:
    """A saved multimodal checkpoint's language model as transformers' causal-LM class of its text
    config, over the checkpoint's language-model weights (what the engine serves of it)."""
    import transformers

    from tgserve.server.loading.language_model import language_model_config, language_model_key_mapping
    from tgserve.server.loading.source import ModelSource

    text = language_model_config(transformers.AutoConfig.from_pretrained(directory), ModelSource(directory))
    model_class = getattr(transformers, text.architectures[0])
    model = model_class.from_pretrained(directory, config=text, key_mapping=language_model_key_mapping())
    return model.float().eval()


def _tiny_config_or_multimodal(model_type: str, ids: Any, **overrides: Any) -> Any:
    """`tiny_config`, or for an image-text-to-text type `tiny_multimodal_config` (served as its
    language model)."""
    try:
        return tiny_config(model_type, ids, **overrides)
    except Refused as why:
        if str(why) != MULTIMODAL:
            raise
    return tiny_multimodal_config(model_type, ids)


def _published_class(config: Any, architecture: str) -> str:
    """The class a checkpoint of this config is published as: for a multimodal config the
    image-text-to-text class (the causal-LM mapping may name the text class, which cannot be built
    from the composite config), else `architecture`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not _language_model_only(config):
        return architecture
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type, architecture)


def _language_model_only(config: Any) -> str:
    """For a multimodal config, what the engine served of it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "" if text is config else f"its language model ({text.model_type}), for text"


def _recomputation(model: Any) -> str:
    """How a model served without keys and values in the paged cache steps: its state kept between
    steps, or its whole sequence recomputed (empty for any other model)."""
    from tgserve.server.models.recompute_fallback import RecomputingFallbackModel

    if not isinstance(model, RecomputingFallbackModel):
        return ""
    if model.kept_states is None:
        return "recomputed: a forward over the whole sequence each step"
    return f"state kept between steps ({model.kept_states.hits} of the steps continued it)"


def engine_refusal(model_type: str, architecture: str) -> str | None:
    """Why the engine refuses every model of this type (a draft model served without its target),
    or None."""
    from tgserve.server.models.registry import UnsupportedModelError, check_not_a_draft_model

    try:
        check_not_a_draft_model(SimpleNamespace(model_type=model_type), architecture)
    except UnsupportedModelError as why:
        return str(why)[:300]
    return None


def uncached_greedy(model: Any, prompt: list[int]) -> list[int]:
    """Greedy tokens from transformers' forward over the whole sequence at every step (no cache)."""
    import torch

    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def run_isolated(model_type: str, architecture: str, timeout_s: float) -> Row:
    """`run_one` in a process of its own: a crash or a hang is a row too."""
    command = [sys.executable, "-m", "tgserve.server.testing.arch_sweep", "--one", model_type, architecture]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Row(model_type, architecture, "failed", f"no result in {timeout_s:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        error = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return Row(model_type, architecture, "failed", error[:300])
    return Row(**json.loads(lines[-1]))


def table(rows: list[Row]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    summary = ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))
    lines = [
        "# Causal-LM architectures of the installed transformers through the engine",
        "",
        f"{len(rows)} architectures: {summary}. `python -m tgserve.server.testing.arch_sweep` (`make test-arch`)",
        "writes this table: each built tiny and random from its own config class, greedy tokens of the",
        "engine (CPU, float32, chunked prefill, a prefix-cache hit) against transformers `generate`.",
        "Learned attention sinks (gpt-oss, native; GraniteMoE-SWA, Granite-SWA, Flint, MiMo-V2-Flash) are",
        "computed by the CPU and CUDA backends; on a Gaudi they are refused by name. Models whose layers",
        "keep state besides keys and values (state-space, linear attention, convolutions, indexed or",
        "differential attention) keep transformers' cache of each sequence between steps where one-token",
        "steps reproduce the model's uncached forward, and are recomputed whole each step where not; the",
        "detail column says which.",
        "",
        "| model_type | class | status | detail |",
        "|---|---|---|---|",
    ]
    for row in rows:
        detail = row.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row.model_type} | {row.architecture} | {row.status} | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as workdir:
            print(json.dumps(asdict(run_one(*args.one, Path(workdir)))))
        return
    wanted = set(args.only.split(",")) if args.only else None
    rows = []
    for model_type, architecture in causal_lm_architectures():
        if wanted is None or model_type in wanted:
            rows.append(run_isolated(model_type, architecture, args.timeout))
            print(f"{model_type}: {rows[-1].status} {rows[-1].detail[:120]}", flush=True)
    text = table(rows)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
