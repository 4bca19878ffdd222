"""`tgserve serve`'s flags: TGI's names, each also read from its environment variable.

This module and the rest of the CLI are the only places that read the environment. A flag given on
the command line wins over its variable, which wins over the default (as TGI's launcher does).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tgserve.router.config import RouterConfig

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# --kv-cache-dtype's names (vLLM's, TGI's fp8_e4m3fn, and int8); the engine maps them to dtypes
# (server/kv_cache/spec.py KV_CACHE_DTYPES), and a test keeps the two lists equal.
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e4m3fn", "int8")


def parse_kv_cache_dtype(text: str) -> str:
    if text not in KV_CACHE_DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {text!r}")
    return text


# --guided-decoding-backend's names (server/sampling/grammar_backends.py GUIDED_DECODING_BACKENDS; a
# test keeps the two lists equal).
GUIDED_DECODING_BACKEND_NAMES = ("llguidance", "xgrammar")


def parse_guided_decoding_backend(text: str) -> str:
    if text not in GUIDED_DECODING_BACKEND_NAMES:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(GUIDED_DECODING_BACKEND_NAMES)}, got {text!r}"
        )
    return text


@dataclass(frozen=True)
class Flag:
    """One option: --name, its variable, type and default. aliases are older TGI spellings."""

    name: str
    kind: Callable[[str], Any]
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    variable: str | None = None  # its environment variable, where that is not the name's

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return self.variable or self.name.replace("-", "_").upper()

    @property
    def variables(self) -> tuple[str, ...]:
        """Its variable, then its aliases' (older TGI spellings)."""
        return (self.env, *(alias.replace("-", "_").upper() for alias in self.aliases))


FLAGS: tuple[Flag, ...] = (
    Flag("model-id", str, None, "Hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)"),
    Flag("revision", str, None, "Hub revision (branch, tag or commit) of the model"),
    Flag("dtype", str, "auto", "Weights and activations dtype: auto, float32, float16, bfloat16"),
    Flag("device", str, "auto", "auto, cpu, cuda or hpu"),
    Flag(
        "quantize",
        str,
        None,
        "Quantize the weights at load: fp8 (CUDA GPUs of compute capability 8.9+, or the CPU; llama family)",
    ),
    Flag(
        "kv-cache-dtype",
        parse_kv_cache_dtype,
        "auto",
        "What the KV cache stores: auto (the model's dtype), fp8 (e4m3) or int8, each with a scale per token "
        "and KV head: twice the tokens of bf16, int8 the closer to it; CUDA and the CPU",
    ),
    Flag(
        "kv-cache-tail",
        parse_bool,
        True,
        "With an 8-bit KV cache, keep each running sequence's current block in the model's dtype too: the "
        "latest keys, which a decoding query weighs most, stay exact (false: every row 8-bit)",
    ),
    Flag(
        "decode-attention-budget",
        int,
        4096,
        "Tokens a decoding sequence past --decode-attention-min-context attends: the blocks its query scores "
        "highest, the first and the most recent (0: always dense; CUDA and the CPU)",
    ),
    Flag("decode-attention-min-context", int, 32768, "Contexts longer than this select blocks to attend"),
    Flag(
        "kv-offload-gb",
        float,
        0.0,
        "GiB of host memory for prefix-cache blocks evicted from the KV pool, loaded back on a hit instead of "
        "recomputed (0: off; CUDA and the CPU)",
    ),
    Flag(
        "guided-decoding-backend",
        parse_guided_decoding_backend,
        "llguidance",
        "The grammar library of structured output (response_format, tools, grammar): llguidance or xgrammar "
        "(install tgserve[xgrammar])",
    ),
    Flag("hostname", str, "0.0.0.0", "Address to listen on"),
    Flag("port", int, 3000, "Port to listen on"),
    Flag("num-shard", int, None, "Tensor-parallel shards (GPUs or HPUs)"),
    Flag("trust-remote-code", parse_bool, False, "Run modeling code shipped with the model (off by default)"),
    Flag(
        "allow-pickle-weights",
        parse_bool,
        False,
        "Load .bin/.pt pickle weights (they can run code; off by default)",
    ),
    Flag("max-concurrent-requests", int, 128, "Requests served at once; more are refused with 429"),
    Flag("max-best-of", int, 2, "Largest `best_of`"),
    Flag("max-stop-sequences", int, 4, "Most stop sequences per request"),
    Flag("max-top-n-tokens", int, 5, "Largest `top_n_tokens` / `logprobs`"),
    Flag(
        "max-input-tokens", int, None, "Longest prompt (default: max-total-tokens - 1)", ("max-input-length",)
    ),
    Flag("max-total-tokens", int, None, "Longest prompt + generation (default: the model's length)"),
    Flag("max-batch-prefill-tokens", int, None, "Token budget of one engine step (prefill chunk size)"),
    Flag("max-batch-total-tokens", int, None, "Tokens of KV cache (default: sized from free memory)"),
    Flag("max-batch-size", int, None, "Requests running in the engine at once"),
    Flag("max-client-batch-size", int, 4, "Most prompts in one /v1/completions request"),
    Flag("payload-limit", int, 2_000_000, "Largest request body, in bytes"),
    Flag(
        "api-key",
        str,
        None,
        "Require `Authorization: Bearer <key>` on every route but /health, /ping, /metrics",
    ),
    Flag("block-size", int, 16, "Tokens per KV cache block"),
    Flag(
        "gpu-memory-utilization",
        float,
        0.9,
        "This server's share of GPU memory (others' use not counted) for weights, activations and the "
        "KV cache, which gets what is left",
    ),
    Flag("cuda-graphs", parse_bool, True, "Replay decode steps as CUDA graphs (CUDA)"),
    Flag(
        "programmatic-dependent-launch",
        parse_bool,
        True,
        "Launch each decode kernel over the tail of the one before (CUDA, Hopper and later)",
        variable="TGSERVE_PDL",
    ),
    Flag(
        "async-scheduling",
        parse_bool,
        None,
        "Schedule the next step while the device runs this one (default: on GPUs)",
    ),
    Flag(
        "static-shapes",
        parse_bool,
        None,
        "Pad steps to bucketed shapes, compiled at warmup (default: on HPUs)",
    ),
    Flag("bucketing", str, "linear", "Bucket sizes of static shapes: 'linear' or 'exponential'"),
    Flag("batch-bucket-size", int, 8, "Decode batch sizes are padded to multiples of this (static shapes)"),
    Flag("prefill-batch-bucket-size", int, 4, "Sequences of a prefill step pad to multiples of this"),
    Flag("pad-sequence-to-multiple-of", int, 128, "Tokens of a prefill step pad to multiples of this"),
    Flag(
        "warmup-enabled",
        parse_bool,
        True,
        "Compile before serving: every static shape (HPU), a few warm-up requests (CUDA)",
    ),
    Flag("enable-hpu-graph", parse_bool, True, "Replay steps as graphs (HPU graphs; CUDA graphs on CUDA)"),
    Flag("limit-hpu-graph", parse_bool, False, "Graphs for decode steps only (saves device memory)"),
    Flag("sparse-prefill", parse_bool, True, "Sparse attention for long prompts, prefilled whole (CUDA)"),
    Flag("sparse-min-tokens", int, None, "Shortest prompt that takes sparse prefill (default: the config's)"),
    Flag("sparse-config", str, None, "Per-layer sparse patterns, JSON (default: the model's, else built in)"),
    Flag("prefix-caching", parse_bool, True, "Reuse the KV cache of shared prompt prefixes"),
    Flag("served-model-name", str, None, "Model name reported by /v1/models (default: the model id)"),
    Flag("cors-allow-origin", str, None, "Comma-separated origins allowed by CORS"),
    Flag("huggingface-hub-cache", str, None, "Hub cache directory (default: $HF_HOME/hub)"),
    Flag("health-timeout", float, 5.0, "Seconds /health waits for the engine loop to answer"),
    Flag(
        "engine-stall-timeout",
        float,
        300.0,
        "Seconds the engine loop may send nothing (one step, or a stopped process) before it is killed, "
        "its requests failed and the server exits non-zero (0: never)",
    ),
    Flag(
        "compute-type", str, None, "What TGI's x-compute-type header reports (default: the engine's device)"
    ),
    Flag("log-level", str, "info", "debug, info, warning or error"),
)


def add_serve_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Every flag, defaulting to its environment variable when that is set."""
    env = os.environ if environ is None else environ
    for flag in FLAGS:
        default = flag.default
        for variable in flag.variables:
            if variable in env:
                default = flag.kind(env[variable])
                break
        options = [f"--{flag.name}", *(f"--{alias}" for alias in flag.aliases)]
        if flag.kind is parse_bool:
            parser.add_argument(
                *options,
                dest=flag.dest,
                type=parse_bool,
                nargs="?",
                const=True,
                default=default,
                help=f"{flag.help} [env {flag.env}]",
            )
        else:
            parser.add_argument(
                *options,
                dest=flag.dest,
                type=flag.kind,
                default=default,
                help=f"{flag.help} [env {flag.env}]",
            )


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The router's limits from the parsed flags (token limits are resolved once the engine is up)."""
    origins = tuple(o.strip() for o in (args.cors_allow_origin or "").split(",") if o.strip())
    return RouterConfig(
        max_concurrent_requests=args.max_concurrent_requests,
        max_best_of=args.max_best_of,
        max_stop_sequences=args.max_stop_sequences,
        max_top_n_tokens=args.max_top_n_tokens,
        max_input_tokens=args.max_input_tokens,
        max_total_tokens=args.max_total_tokens,
        max_client_batch_size=args.max_client_batch_size,
        payload_limit=args.payload_limit,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name,
        health_timeout_s=args.health_timeout,
        cors_allow_origin=origins,
        compute_type=args.compute_type or None,
    )


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineArgs` keywords. Optional ones are passed only when set, so an engine that lacks a
    feature fails loudly only when that feature is asked for."""
    result: dict[str, Any] = {
        "model": args.model_id,
        "revision": args.revision,
        "dtype": args.dtype,
        "device": args.device,
        "block_size": args.block_size,
        "enable_prefix_caching": args.prefix_caching,
        "trust_remote_code": args.trust_remote_code,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "cuda_graphs": args.cuda_graphs,
        "programmatic_dependent_launch": args.programmatic_dependent_launch,
        "sparse_prefill": args.sparse_prefill,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_tail": args.kv_cache_tail,
        "decode_attention_budget": args.decode_attention_budget,
        "decode_attention_min_context": args.decode_attention_min_context,
        "kv_offload_gb": args.kv_offload_gb,
        "guided_decoding_backend": args.guided_decoding_backend,
    }
    if args.allow_pickle_weights:
        result["allow_pickle"] = True
    optional = {
        "max_num_batched_tokens": args.max_batch_prefill_tokens,
        "max_num_seqs": args.max_batch_size,
        "max_model_len": args.max_total_tokens,
        "num_blocks": (
            math.ceil(args.max_batch_total_tokens / args.block_size) if args.max_batch_total_tokens else None
        ),
        "tensor_parallel_size": args.num_shard if args.num_shard and args.num_shard > 1 else None,
        "sparse_min_seq_len": args.sparse_min_tokens,
        "async_scheduling": args.async_scheduling,
        "static_shapes": args.static_shapes,
        "sparse_config": args.sparse_config,
        "quantize": args.quantize,
        "warm_up": None if args.warmup_enabled else False,  # None: the engine decides (GPUs only)
    }
    result.update({key: value for key, value in optional.items() if value is not None})
    result["buckets"] = bucket_config(args)
    return result


def bucket_config(args: argparse.Namespace) -> dict[str, Any]:
    """`BucketConfig` keywords: the buckets of static shapes, used when they are on."""
    return {
        "scheme": args.bucketing,
        "batch_step": args.batch_bucket_size,
        "prefill_batch_step": args.prefill_batch_bucket_size,
        "token_step": args.pad_sequence_to_multiple_of,
        "warmup": args.warmup_enabled,
        "graphs": args.enable_hpu_graph,
        "decode_graphs_only": args.limit_hpu_graph,
    }


def engine_environment(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine process's environment: ours, plus what the flags say about the Hub cache."""
    env = dict(os.environ if environ is None else environ)
    if args.huggingface_hub_cache:
        env["HF_HUB_CACHE"] = args.huggingface_hub_cache
    return env
