"""EngineArgs: everything an engine is built from, frozen, built once by the CLI or the offline API."""

from __future__ import annotations

from dataclasses import dataclass

from tgserve.server.config.buckets import BucketConfig


@dataclass(frozen=True)
class EngineArgs:
    """Everything the engine is built from. model=None serves the default SmolLM2-135M-Instruct."""

    model: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPUs and HPUs
    device: str = "auto"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    trust_remote_code: bool = False
    allow_pickle: bool = False
    force_transformers_fallback: bool = False
    load_format: str = "auto"  # "dummy": random weights from the config alone (benchmarks)
    quantize: str | None = (
        None  # "fp8": projections stored and multiplied in fp8 (server/loading/quantization.py)
    )
    # What the KV cache stores: "auto" (the model's dtype) or "fp8" (e4m3 with a scale per token and
    # KV head, half the bytes of bf16; kv_cache/spec.py). vLLM's flag and names.
    kv_cache_dtype: str = "auto"
    # An 8-bit cache keeps each running sequence's current block in the model's dtype too, the keys
    # a decoding query weighs most (kv_cache/tail_blocks.py): one block a sequence beside the pool.
    kv_cache_tail: bool = True
    # Selective decode attention (kernels/decode_selection.py): a decoding sequence whose context is
    # longer than decode_attention_min_context tokens attends over decode_attention_budget of them,
    # the blocks its query's heads score highest (0: always dense). Blocks keep key summaries only
    # where the model's length passes the threshold. CPU and CUDA.
    decode_attention_budget: int = 4096
    decode_attention_min_context: int = 32768
    # Host memory (GiB, all shards together) for full prefix blocks evicted from the KV pool: a
    # later request with that prefix loads them back instead of recomputing (0: off). CUDA and the
    # CPU (where a second CPU pool stands in for host memory); core/host_tier.py.
    kv_offload_gb: float = 0.0
    # The grammar library of guided decoding: "llguidance" or "xgrammar" (sampling/grammar_backends.py).
    guided_decoding_backend: str = "llguidance"
    tensor_parallel_size: int = 1  # --num-shard: shards of the model, one device each (llama family)
    # Schedule step N+1 while the device runs step N (None: on GPUs, where the host would otherwise
    # idle the device; on the CPU there is nothing to overlap).
    async_scheduling: bool | None = None
    # Steps padded to static shapes and every shape compiled before serving (None: on HPUs only).
    static_shapes: bool | None = None
    buckets: BucketConfig = BucketConfig()  # the static shapes' buckets (tgi-gaudi's knobs)
    # CUDA only
    # This engine's share of the GPU's memory (others' use not counted, as in vLLM); the KV pool gets
    # what the weights and the largest step leave of it.
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True  # decode steps replay captured graphs (batch sizes up to max_cuda_graph_batch)
    max_cuda_graph_batch: int = 256
    sparse_prefill: bool = True  # prompts of at least sparse_min_seq_len tokens take sparse attention
    sparse_config: str | None = None  # per-layer head patterns (JSON); default: the model's own, if any
    sparse_min_seq_len: int | None = None  # overrides the config's threshold
    # Decode kernels launch with programmatic dependent launch on Hopper and later (each overlaps
    # the tail of the one before); off for A/B runs (--programmatic-dependent-launch, TGSERVE_PDL).
    programmatic_dependent_launch: bool = True
    # Run a few requests before serving so first requests do not compile kernels (None: on GPUs,
    # where Triton compiles on first use; server/engine/warm_up.py).
    warm_up: bool | None = None
