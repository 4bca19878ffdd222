"""LLMEngine: the continuous-batching loop's one step, over a model, a paged KV pool and a scheduler.

`add_request` validates and queues; `step` schedules, runs the model once and returns per-request
deltas. A bad request is refused at `add_request` with InvalidRequestError and never reaches the
loop, so it cannot stop the engine from serving the others.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tgserve.kernels.sparse.config import SparseConfig, load_sparse_config
from tgserve.server.attention.backend import attention_backend
from tgserve.server.config import SchedulerConfig
from tgserve.server.core.request import FinishReason, Request
from tgserve.server.core.scheduler import Scheduler
from tgserve.server.cuda_graphs import DecodeGraphs
from tgserve.server.kv_cache import allocate_kv_caches, kv_cache_specs, num_blocks_for_memory
from tgserve.server.loader import ModelSource, load_config, load_tokenizer, resolve_model
from tgserve.server.memory import MemoryProfile, profile_kv_budget
from tgserve.server.model_loader import load_model
from tgserve.server.outputs import EngineStats, RequestOutput, TokenLogprob
from tgserve.server.runner import ModelRunner, RunnerOutput
from tgserve.server.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
SPARSE_CONFIG_FILE = "sparse_attention.json"
# Captured decode graphs size their context splits for this many tokens; longer contexts stay
# correct (the last split runs to the end) but use fewer parallel splits.
GRAPH_CONTEXT_BOUND = 8192
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineArgs:
    """Everything the engine is built from. model=None serves the default SmolLM2-135M-Instruct."""

    model: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPUs
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
    tensor_parallel_size: int = 1  # --num-shard; one device only, for now
    # CUDA only
    gpu_memory_utilization: float = 0.9  # share of the GPU the engine may fill; the KV pool gets the rest
    cuda_graphs: bool = True  # decode steps replay captured graphs (batch sizes up to max_cuda_graph_batch)
    max_cuda_graph_batch: int = 256
    sparse_prefill: bool = True  # prompts of at least sparse_min_seq_len tokens take sparse attention
    sparse_config: str | None = None  # per-layer head patterns (JSON); default: the model's own, if any
    sparse_min_seq_len: int | None = None  # overrides the config's threshold


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


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


class LLMEngine:
    """One model on one device, served by continuous batching over a paged KV cache."""

    def __init__(self, args: EngineArgs) -> None:
        if args.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor parallelism is not supported yet: --num-shard {args.tensor_parallel_size} asks for "
                f"{args.tensor_parallel_size} devices; serve on one (--num-shard 1)"
            )
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.source = resolve_model(args.model, args.revision, args.allow_pickle)
        self.model_id = args.model or "HuggingFaceTB/SmolLM2-135M-Instruct"
        self.config = load_config(self.source, args.trust_remote_code)
        self.tokenizer = load_tokenizer(self.source, args.trust_remote_code)
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer, self.source)
        self.vocab_size = int(self.config.vocab_size)
        self.max_model_len = min(
            args.max_model_len or config_max_len(self.config), config_max_len(self.config)
        )
        model = load_model(
            self.source,
            self.config,
            self.dtype,
            self.device,
            args.trust_remote_code,
            args.allow_pickle,
            args.force_transformers_fallback,
            args.load_format,
        )
        self.specs = kv_cache_specs(self.config, self.dtype)
        backend = attention_backend(self.device, self._sparse_config())
        self.runner = ModelRunner(model, [], self.specs, backend, args.block_size, self.device)
        self.memory_profile: MemoryProfile | None = None
        self.num_blocks = self._size_kv_pool()
        self.runner.kv_caches = allocate_kv_caches(self.specs, self.num_blocks, args.block_size, self.device)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                num_blocks=self.num_blocks,
                enable_prefix_caching=args.enable_prefix_caching,
            )
        )
        if self.device.type == "cuda" and args.cuda_graphs:
            self._capture_graphs()
        self._last_step = (0, 0)
        # Prompt log-probabilities gathered over a request's prefill chunks, sent with its first token.
        self._prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens",
            self.source.display_name,
            self.num_blocks,
            args.block_size,
        )

    # -- set-up -----------------------------------------------------------------------------------

    def _sparse_config(self) -> SparseConfig | None:
        """Sparse prefill patterns: the given file, else the model's `sparse_attention.json`, else defaults."""
        if not self.args.sparse_prefill or self.device.type != "cuda":
            return None
        path = self.args.sparse_config
        if path is None and (self.source.directory / SPARSE_CONFIG_FILE).is_file():
            path = str(self.source.directory / SPARSE_CONFIG_FILE)
        config = load_sparse_config(path)
        if self.args.sparse_min_seq_len is not None:
            config = dataclasses.replace(config, min_seq_len=self.args.sparse_min_seq_len)
        return config

    def _size_kv_pool(self) -> int:
        """Blocks in the KV pool: as given, else what the profiled GPU memory or the CPU budget holds."""
        args = self.args
        if args.num_blocks:
            return args.num_blocks
        if self.device.type != "cuda" or args.kv_cache_memory_bytes:
            memory = args.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
            return num_blocks_for_memory(self.specs, args.block_size, memory)
        self.runner.kv_caches = allocate_kv_caches(self.specs, 1, args.block_size, self.device)
        self.memory_profile = profile_kv_budget(
            self.runner.forward,
            args.max_num_batched_tokens,
            args.max_num_seqs,
            args.block_size,
            args.gpu_memory_utilization,
            self.device,
        )
        self.runner.kv_caches = []
        logger.info(self.memory_profile.describe())
        return num_blocks_for_memory(self.specs, args.block_size, self.memory_profile.kv_budget_bytes)

    def _capture_graphs(self) -> None:
        block_size = self.args.block_size
        graphs = DecodeGraphs(
            self.runner.forward,
            max_batch=min(self.args.max_num_seqs, self.args.max_cuda_graph_batch),
            max_blocks_per_seq=-(-self.max_model_len // block_size),
            block_size=block_size,
            context_bound=min(self.max_model_len, GRAPH_CONTEXT_BOUND),
            device=self.device,
        )
        try:
            graphs.capture()
        except RuntimeError as exc:  # e.g. host copies or data-dependent shapes in a model's code
            torch.cuda.synchronize(self.device)
            logger.warning("CUDA graphs are off: this model's decode step cannot be captured (%s)", exc)
            return
        self.runner.graphs = graphs

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate and queue a request; raises InvalidRequestError naming the problem and the limit."""
        self._validate(request_id, prompt_token_ids)
        self.scheduler.add_request(Request(request_id, prompt_token_ids, params, self.eos_token_ids))
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = []

    def _validate(self, request_id: str, prompt: list[int]) -> None:
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if len(prompt) == 0:
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})"
            )
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens but the model's context is {self.max_model_len} tokens: "
                f"at most {self.max_model_len - 1} prompt tokens leave room for one new token"
            )
        capacity = self.num_blocks * self.args.block_size
        if len(prompt) + 1 > capacity:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens but the KV cache holds at most {capacity} tokens"
            )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.scheduler.abort_requests(request_ids)
        for request_id in request_ids:
            self._prompt_logprobs.pop(request_id, None)

    def finish_request(self, request_id: str, reason: str | FinishReason) -> None:
        """End a request early, e.g. with "stop_sequence" when a stop string was found downstream."""
        self.scheduler.finish_request(request_id, FinishReason(reason))
        self._prompt_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def needs_step(self) -> bool:
        """Unfinished requests, or finished ones (aborts, stop strings) whose state a step releases."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that gained a token or finished."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        self._last_step = (
            scheduler_output.total_num_scheduled_tokens,
            len(scheduler_output.num_scheduled_tokens),
        )
        updated = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        self._collect_prompt_logprobs(runner_output)
        return [self._output(request, runner_output) for request in updated]

    def _collect_prompt_logprobs(self, runner_output: RunnerOutput) -> None:
        for request_id, (first, scored) in runner_output.prompt_logprobs.items():
            collected = self._prompt_logprobs.get(request_id)
            if collected is None:
                continue
            # Position p of the prompt is entry p - 1. A preempted request recomputes its prompt:
            # positions already collected are skipped.
            collected.extend(scored[len(collected) - (first - 1) :])

    def _output(self, request: Request, runner_output: RunnerOutput) -> RequestOutput:
        sampled = request.request_id in runner_output.sampled_token_ids
        logprob = runner_output.logprobs.get(request.request_id)
        prompt_logprobs = None
        if sampled or request.is_finished:
            collected = self._prompt_logprobs.pop(request.request_id, None)
            prompt_logprobs = None if collected is None else [None, *collected]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[request.output_token_ids[-1]] if sampled else [],
            new_logprobs=[logprob] if logprob is not None else None,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_output_tokens=request.num_output_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        tokens, seqs = self._last_step
        return EngineStats(**{**stats.__dict__, "step_num_tokens": tokens, "step_num_seqs": seqs})
