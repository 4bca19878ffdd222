"""One tensor-parallel shard of a model on its device: the weights, the KV pool, the executor that
runs its steps and the runner.

With one shard (the default) it is the whole model. The engine builds one in its own process (rank
0); with `tensor_parallel_size > 1` every other rank builds its own in a worker process
(`shard_workers.py` beside this module), and all of them take the same steps together.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from tgserve.kernels.decode_selection import DecodeSelection
from tgserve.kernels.sparse.config import SparseConfig, load_sparse_config
from tgserve.server.attention.registry import attention_backend
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.distributed.tensor_parallel import TensorParallel
from tgserve.server.execution.cuda_graphs import CudaGraphExecutor, DecodeGraphs
from tgserve.server.execution.executor import EagerExecutor, StepExecutor
from tgserve.server.execution.forward import ModelForward
from tgserve.server.execution.memory import (
    GIB,
    MemoryProfile,
    check_kv_budget,
    check_share_is_free,
    device_at_start,
    profile_step,
)
from tgserve.server.execution.runner import ModelRunner
from tgserve.server.kv_cache.host_pool import HostKVPool
from tgserve.server.kv_cache.key_copies import key_copy_bytes
from tgserve.server.kv_cache.pool import num_blocks_for_memory
from tgserve.server.kv_cache.spec import (
    kv_bytes_per_token,
    kv_cache_dtype,
    kv_cache_specs,
    with_key_summaries,
)
from tgserve.server.kv_cache.tail_blocks import tail_bytes
from tgserve.server.loading.description import ModelDescription
from tgserve.server.loading.source import ModelSource
from tgserve.server.models.kept_states import KeptStates
from tgserve.server.models.loader import load_model
from tgserve.server.static_shapes.buckets import StaticShapes
from tgserve.server.static_shapes.executor import StaticShapeExecutor
from tgserve.server.static_shapes.graphs import StepGraphs, StepModule

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
# The most of the KV budget the long-context tier's key copies may take (`HostKeyCopies`). Each host
# block's copy costs a quarter of a bf16 block and saves its candidates' keys crossing the link
# every step; the pool's blocks it takes spill instead, and their chosen keys and values cross.
KEY_COPY_SHARE = 1 / 6
# The most of the KV budget the hot-block cache may take (`HotBlockCache`: device blocks holding the
# host blocks selective decode chose lately). Two 512K-token contexts of Llama-3-8B choose ~220 host
# blocks a step per layer and KV head; 1/24 of a ~100 GiB budget is ~2,000 slots, nine steps' worth.
HOT_BLOCK_SHARE = 1 / 24
SPARSE_CONFIG_FILE = "sparse_attention.json"
# Captured decode graphs size their context splits for this many tokens; longer contexts stay
# correct (the last split runs to the end) but use fewer parallel splits.
GRAPH_CONTEXT_BOUND = 8192


class ModelShard:
    """Loads this rank's share of the model; `allocate` adds the KV pool, chooses the executor and
    builds the runner."""

    def __init__(
        self,
        args: EngineArgs,
        source: ModelSource,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.args, self.source, self.device, self.max_model_len = args, source, device, max_model_len
        self.model_dtype = dtype
        self.key_copy_slots: int | None = None  # set as the pool is sized
        self.hot_slots: int | None = None  # likewise: the hot-block cache's device blocks
        cache_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)  # a wrong name fails before the load
        # Before the weights: what others hold is not this server's, and a share that is not free
        # fails here rather than after a long load.
        self.device_at_start = None
        if self._profiles_gpu_memory():
            self.device_at_start = device_at_start(device)
            check_share_is_free(self.device_at_start, args.gpu_memory_utilization)
        if device.type == "cuda":
            from tgserve.kernels.triton_common import set_programmatic_dependent_launch  # Triton: CUDA only

            set_programmatic_dependent_launch(args.programmatic_dependent_launch)
        model = load_model(
            source,
            config,
            dtype,
            device,
            args.trust_remote_code,
            args.allow_pickle,
            args.force_transformers_fallback,
            args.load_format,
            args.quantize,
        )
        own_specs = getattr(model, "kv_cache_specs", None)  # a model that keeps other than keys and values
        # A model that keeps its sequences' state outside the pool (`_pool_beside_kept_states`).
        self.kept_states: KeptStates | None = getattr(model, "kept_states", None)
        self.specs = list(own_specs or kv_cache_specs(config, cache_dtype, args.tensor_parallel_size))
        self.selection = None if own_specs else self._decode_selection()
        if self.selection is not None:
            self.specs = with_key_summaries(self.specs, dtype)
        self.backend = attention_backend(device, self._sparse_config(), self.selection)
        if self.specs[0].scaled and not self.backend.reads_scaled_kv:
            raise ValueError(
                f"--kv-cache-dtype {args.kv_cache_dtype}: the {self.backend.name} backend keeps its KV cache in the "
                "model's dtype (an 8-bit cache runs on cpu and cuda); use --kv-cache-dtype auto"
            )
        self._check_host_tier(device)
        self.forward = ModelForward(model, self.backend, self.specs)
        static = device.type == "hpu" if args.static_shapes is None else args.static_shapes
        self.buckets = args.buckets if static else None
        self.shapes = None
        if self.buckets is not None:
            self.shapes = StaticShapes(
                self.buckets, args.max_num_seqs, args.max_num_batched_tokens, max_model_len, args.block_size
            )
        # Set by `allocate`: the executor's parts, kept for their logs and counters.
        self.static_executor: StaticShapeExecutor | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.long_decode_graphs: DecodeGraphs | None = None  # selective decode's (long contexts)
        self.runner: ModelRunner | None = None
        self.memory_profile: MemoryProfile | None = None
        # A whole prompt of the model's length, profiled where long prompts are prefilled whole
        # (None: not profiled, or it did not fit in memory).
        self.whole_prompt_profile: MemoryProfile | None = None
        self.num_blocks = 0  # until `allocate`
        self.host_pool: HostKVPool | None = None  # the host tier's memory (--kv-offload-gb)
        self.whole_prompt_tokens = self._whole_prompt_tokens()

    def _whole_prompt_tokens(self) -> int | None:
        """From what length prompts are prefilled whole, in a step of their own (the scheduler's
        `whole_prompt_tokens`): the backend's (the sparse threshold on CUDA) where the model's
        length reaches it. Static shapes bucket every step under the token budget: none there. On
        a GPU whose KV pool size is given rather than profiled, nothing measures what such a step
        needs beside the pool, so long prompts are chunked there too, and the log says so."""
        whole = self.backend.whole_prompt_tokens
        if whole is None or whole > self.max_model_len or self.buckets is not None:
            return None
        if self.device.type == "cuda" and not self._profiles_gpu_memory():
            logger.warning(
                "prompts of %d tokens or more are prefilled in chunks, with dense attention: the KV cache's "
                "size is given (--max-batch-total-tokens), so the memory a whole prompt's step needs beside it "
                "is not measured; without it the cache is sized by profiling such a step, and they are "
                "prefilled whole, with sparse attention",
                whole,
            )
            return None
        return whole

    def _decode_selection(self) -> DecodeSelection | None:
        """Selective decode attention, where contexts of the model's length pass its threshold (a
        budget that leaves nothing to choose fails here, before the pool is sized)."""
        args = self.args
        if args.decode_attention_budget <= 0:
            return None
        selection = DecodeSelection.for_budget(
            args.decode_attention_budget, args.decode_attention_min_context
        )
        selection.check(args.block_size)
        if self.max_model_len <= selection.min_context:
            return None
        if self.device.type not in ("cpu", "cuda"):
            logger.info("decode attention is dense for every context: selective decode runs on cpu and cuda")
            return None
        logger.info(
            "decoding sequences past %d tokens of context attend over %d of them (--decode-attention-budget; "
            "0 turns it off)",
            selection.min_context,
            selection.budget,
        )
        return selection

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

    def _profiles_gpu_memory(self) -> bool:
        """Whether the KV pool is sized by profiling GPU memory: neither blocks nor bytes are given."""
        args = self.args
        return self.device.type == "cuda" and not args.num_blocks and not args.kv_cache_memory_bytes

    def size_kv_pool(self) -> int:
        """Blocks in the KV pool: as given, else what the profiled GPU memory or the CPU budget holds.

        On a GPU this runs the largest step (and, where long prompts are prefilled whole, a whole
        prompt of the model's length): with several shards, every rank must call it.
        """
        args = self.args
        if args.num_blocks:
            return self._pool_beside_kept_states(args.num_blocks, args.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES,
                                                 given=True)  # fmt: skip
        scratch = self.backend.scratch_blocks  # allocated beyond the block manager's blocks
        if not self._profiles_gpu_memory():
            memory = self._less_host_tier_copies(
                (args.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES)
                - self.host_summary_bytes
                - self.tail_bytes
            )
            blocks = max(1, num_blocks_for_memory(self.specs, args.block_size, memory) - scratch)
            return self._pool_beside_kept_states(blocks, memory)
        self.forward.allocate_pool(1, args.block_size, self.device)
        budget_step = self._profile_step(args.max_num_batched_tokens, args.max_num_seqs)
        self.memory_profile = check_kv_budget(
            budget_step, args.max_num_batched_tokens, args.gpu_memory_utilization
        )
        if self.whole_prompt_tokens is not None:
            self._profile_whole_prompt(self._whole_prompt_step())
        self.forward.release_pool()
        logger.info(self.memory_profile.describe())
        budget = self._less_host_tier_copies(
            self.memory_profile.kv_budget_bytes - self.host_summary_bytes - self.tail_bytes
        )
        blocks = max(1, num_blocks_for_memory(self.specs, args.block_size, budget) - scratch)
        return self._pool_beside_kept_states(blocks, budget)

    def _pool_beside_kept_states(self, blocks: int, budget: int, given: bool = False) -> int:
        """For a model that keeps its sequences' state outside the pool (`KeptStates`: the pool holds
        token ids, 4 bytes a token), the pool's blocks (unless `given`) are capped at what the
        running sequences can fill at the model's length, and the budget's rest bounds the kept
        states (at most two a running sequence: stale ones of finished or preempted sequences go
        first); those the profiling step left are dropped. Any other model: `blocks` as they are."""
        if self.kept_states is None:
            return blocks
        args = self.args
        self.kept_states.clear()
        if not given:
            blocks = min(blocks, args.max_num_seqs * -(-self.max_model_len // args.block_size))
        pool_bytes = blocks * self.device_block_bytes
        self.kept_states.max_states = 2 * args.max_num_seqs
        self.kept_states.max_bytes = max(0, budget - pool_bytes)
        logger.info("kept sequence states: at most %d, %.2f GiB", self.kept_states.max_states,
                    self.kept_states.max_bytes / (1 << 30))  # fmt: skip
        return blocks

    def _less_host_tier_copies(self, budget: int) -> int:
        """The KV budget less what the host blocks' key copies and the hot-block cache take of it
        (`key_copy_slots` and `hot_slots` set)."""
        self.key_copy_slots = self._key_copy_slots(budget)
        self.hot_slots = self._hot_slots(budget)
        return (
            budget
            - self.key_copy_slots * self.key_copy_block_bytes
            - self.hot_slots * self.device_block_bytes
        )

    def _profile_step(self, num_tokens: int, num_seqs: int) -> MemoryProfile:
        """A prefill step of `num_tokens` over `num_seqs` sequences run on this GPU and measured."""
        args = self.args
        return profile_step(self.forward, num_tokens, num_seqs, args.block_size,
                            args.gpu_memory_utilization, self.device, self.device_at_start)  # fmt: skip

    def _whole_prompt_step(self) -> MemoryProfile | None:
        """The profile of a whole prompt of the model's length, or None where it does not fit on the
        GPU at all (a model of a million tokens' context)."""
        try:
            return self._profile_step(self.max_model_len, 1)
        except torch.cuda.OutOfMemoryError:
            pass  # the step's tensors are released with the exception, at the end of this clause
        torch.cuda.empty_cache()
        return None

    def _profile_whole_prompt(self, longest: MemoryProfile | None) -> None:
        """Keep the smaller KV budget of the two largest steps: the token budget's, and a whole prompt
        of the model's length (`longest`). Where that prompt's step leaves less than one request of
        that length needs, or did not fit at all, long prompts are chunked instead (dense
        attention), and the log says so."""
        one_request = self.max_model_len * kv_bytes_per_token(self.specs, self.args.block_size)
        self.whole_prompt_profile = longest
        if longest is not None and longest.kv_budget_bytes >= one_request:
            self.memory_profile = min(self.memory_profile, longest, key=lambda p: p.kv_budget_bytes)
            logger.info(
                "prompts of %d to %d tokens are prefilled whole, sparse: the longest one's step peaks at "
                "%.2f GiB of activations and leaves %.2f GiB for the KV cache",
                self.whole_prompt_tokens,
                self.max_model_len,
                longest.activation_peak_bytes / GIB,
                longest.kv_budget_bytes / GIB,
            )
            return
        step = f"a whole {self.max_model_len}-token prompt's step"
        if longest is None:
            why = f"{step} does not fit in GPU memory"
        else:
            why = (
                f"{step} leaves {max(longest.kv_budget_bytes, 0) / GIB:.2f} GiB for the KV cache, less than the "
                f"{one_request / GIB:.2f} GiB one such request needs"
            )
        logger.warning(
            "prompts of %d tokens or more are prefilled in chunks, with dense attention: %s (lower "
            "--max-total-tokens or raise --gpu-memory-utilization to prefill them whole, sparse)",
            self.whole_prompt_tokens,
            why,
        )
        self.whole_prompt_tokens = None

    def allocate(self, num_blocks: int) -> None:
        """The KV pool, then the executor (CUDA graphs capture steps over the pool; static shapes
        are warmed up over it), then the runner that steps through them."""
        self.num_blocks = num_blocks
        if self.key_copy_slots is None:  # a pool of blocks as given: copies and hot blocks beside its bytes
            pool_bytes = num_blocks * self.device_block_bytes  # this shard's, as the copies' bytes are
            self.key_copy_slots = self._key_copy_slots(pool_bytes)
            self.hot_slots = self._hot_slots(pool_bytes)
        self.forward.allocate_pool(self.first_host_block_id, self.args.block_size, self.device)
        tails = self.forward.attach_tails(self.tail_slots, self.model_dtype)
        if tails is not None:
            logger.info("8-bit KV cache: each running sequence's current block also kept in %s, %d slots (%.2f GiB)",
                        str(self.model_dtype).removeprefix("torch."), tails.num_slots, self.tail_bytes / GIB)  # fmt: skip
        if self.num_host_blocks:
            self.host_pool = HostKVPool(self.forward.block_tensors(), self.num_host_blocks, self.device)
            if self.spill_keep is not None:
                first = self.first_host_block_id
                summaries, copies, hot = self.forward.attach_host_tier(self.host_pool.layer_views(), first,
                                                                       self.key_copy_slots, self.hot_slots)  # fmt: skip
                self.host_pool.keep_on_device(summaries, copies, hot)
                if copies is not None:
                    logger.info("keys of %d host blocks copied to the device for block selection (%.2f GiB)",
                                copies.num_slots, copies.num_slots * self.key_copy_block_bytes / GIB)  # fmt: skip
                if hot is not None:
                    logger.info("hot-block cache: %d device blocks hold the host blocks decode chose lately "
                                "(%.2f GiB)", hot.slots, hot.slots * self.device_block_bytes / GIB)  # fmt: skip
        executor = self._choose_executor()
        if self.static_executor is not None and self.buckets.warmup:
            self.static_executor.warm_up(self.args.block_size, self.device)
        if self.kept_states is not None:  # the states of capture's and warm-up's steps
            self.kept_states.clear()
        self.runner = ModelRunner(
            self.forward, executor, self.args.block_size, self.device, self.host_pool, tails
        )
        if self.args.tensor_parallel_size > 1:
            # Every rank samples the same rows: none defers a late mask by its own clock.
            self.runner.late_mask_grace_s = None

    def _check_host_tier(self, device: torch.device) -> None:
        gib = self.args.kv_offload_gb
        if gib and device.type not in ("cpu", "cuda"):
            raise ValueError(f"--kv-offload-gb: the host KV tier runs on cpu and cuda, not {device.type}")
        if gib < 0 or (gib and not self.num_host_blocks):
            raise ValueError(
                f"--kv-offload-gb {gib}: the host tier must hold at least one block of this model "
                f"({self.host_block_bytes / 2**20:.2f} MiB), or be 0 (off)"
            )

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one KV block across every layer and shard: what the host tier holds a block in."""
        return self.device_block_bytes * self.args.tensor_parallel_size

    @property
    def spill_keep(self) -> tuple[int, int] | None:
        """The long-context tier: the (first, last) blocks a request keeps in the pool when its
        cold ones spill to the host tier (the attention sink and the recent window selective decode
        always reads, the current block among them); None where there is no host tier or the
        backend cannot read host blocks in place."""
        if not self.num_host_blocks or not self.backend.reads_host_blocks:
            return None
        if self.selection is None:
            return 1, 2
        block_size = self.args.block_size
        return self.selection.sink_blocks(block_size), self.selection.recent_blocks(block_size) + 1

    @property
    def tail_slots(self) -> int:
        """An 8-bit cache's tail slots (`TailBlocks`): one a running sequence; 0 without a tail."""
        return self.args.max_num_seqs if self.args.kv_cache_tail and self.specs[0].scaled else 0

    @property
    def tail_bytes(self) -> int:
        """Device memory the tail slots take, from the KV pool's budget."""
        return tail_bytes(self.specs, self.args.block_size, self.tail_slots, self.model_dtype)

    @property
    def host_summary_bytes(self) -> int:
        """Device memory the long-context tier keeps for its host blocks' key summaries (what
        selection reads of them every step), taken from the KV pool's budget."""
        if self.spill_keep is None:
            return 0
        return self.num_host_blocks * sum(spec.summary_bytes() for spec in self.specs)

    @property
    def key_copy_block_bytes(self) -> int:
        """A host block's key copies on the device, every selecting layer's (`HostKeyCopies`); 0
        where the long-context tier does not select."""
        if self.spill_min_context is None:
            return 0
        selecting = [
            spec for spec in self.specs if spec.summary_dtype is not None and spec.reads_kv_of is None
        ]
        return sum(
            key_copy_bytes(self.args.block_size, spec.num_kv_heads, spec.head_dim) for spec in selecting
        )

    def _key_copy_slots(self, budget: int) -> int:
        """Host blocks whose keys the device copies: as many as the host tier holds, within
        KEY_COPY_SHARE of the KV budget."""
        per_block = self.key_copy_block_bytes
        return 0 if not per_block else min(self.num_host_blocks, int(budget * KEY_COPY_SHARE) // per_block)

    @property
    def device_block_bytes(self) -> int:
        """Bytes of one block of this shard's pool, every layer's."""
        return sum(spec.bytes_per_block(self.args.block_size) for spec in self.specs)

    def _hot_slots(self, budget: int) -> int:
        """Device blocks of the hot-block cache: HOT_BLOCK_SHARE of the KV budget, no more than the
        host tier's blocks; none where the long-context tier does not select."""
        if self.spill_min_context is None:
            return 0
        return min(self.num_host_blocks, int(budget * HOT_BLOCK_SHARE) // self.device_block_bytes)

    @property
    def first_host_block_id(self) -> int:
        """The block-table id of host block 0: past the pool's blocks, its scratch blocks and the
        hot-block cache's (`allocate` sets the pool)."""
        return self.num_blocks + self.backend.scratch_blocks + (self.hot_slots or 0)

    @property
    def spill_min_context(self) -> int | None:
        """Contexts past selective decode's threshold read only a budget of their blocks, wherever
        they lie: they may spill to make room for others. None without spilling or selection."""
        return None if self.spill_keep is None or self.selection is None else self.selection.min_context

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host tier: --kv-offload-gb over every shard's bytes of a block (each shard
        keeps its share of a block, so the shards together hold that many GiB)."""
        return max(0, int(self.args.kv_offload_gb * 2**30) // self.host_block_bytes)

    def _choose_executor(self) -> StepExecutor:
        """The one choice of how steps run: padded to static shapes or as they are, and on CUDA
        with graphs on, decode steps replayed from captured graphs in front of either."""
        executor: StepExecutor = EagerExecutor(self.forward)
        if self.shapes is not None:
            self.static_executor = StaticShapeExecutor(self.shapes, self.forward, self._step_graphs())
            executor = self.static_executor
        graphs = self.args.cuda_graphs and (self.buckets is None or self.buckets.graphs)
        if self.device.type == "cuda" and graphs:
            self.decode_graphs = self._capture_graphs()
            if self.decode_graphs is not None and self.selection is not None:
                self.long_decode_graphs = self._capture_graphs(long_contexts=True)
        if self.decode_graphs is not None:
            long_context = None if self.selection is None else self.selection.min_context
            executor = CudaGraphExecutor(self.decode_graphs, executor, self.long_decode_graphs, long_context)
        return executor

    def _step_graphs(self) -> StepGraphs | None:
        """Padded steps as modules of tensors, where the backend's work depends on shapes alone;
        graph-wrapped by the backend when graphs are on (ENABLE_HPU_GRAPH; LIMIT_HPU_GRAPH keeps
        prefill shapes out)."""
        if not self.backend.shape_only:
            return None
        plain = StepModule(self.forward, self.args.block_size)
        graphed = self.backend.graph_wrap(plain) if self.buckets.graphs else plain
        return StepGraphs(graphed, plain, self.buckets.decode_graphs_only)

    def _capture_graphs(self, long_contexts: bool = False) -> DecodeGraphs | None:
        """Decode graphs for every batch size; with `long_contexts`, the selective decode steps of
        contexts past the threshold (their bound is the model's length, which turns selection on),
        for as many such sequences as the pool holds."""
        block_size = self.args.block_size
        max_batch = min(self.args.max_num_seqs, self.args.max_cuda_graph_batch)
        bound = min(self.max_model_len, GRAPH_CONTEXT_BOUND)
        sizes = self.shapes.decode_batch if self.shapes is not None else None  # static shapes: the buckets
        if long_contexts:
            bound = self.max_model_len
            max_batch = max(
                1, min(max_batch, self.num_blocks * block_size // (self.selection.min_context + 1))
            )
            sizes = None if sizes is None else [s for s in sizes if s <= max_batch] or [max_batch]
        graphs = DecodeGraphs(
            self.forward,
            max_batch=max_batch,
            max_blocks_per_seq=-(-self.max_model_len // block_size),
            block_size=block_size,
            context_bound=bound,
            device=self.device,
            sizes=sizes,
        )
        try:
            graphs.capture()
        except RuntimeError as exc:  # e.g. host copies or data-dependent shapes in a model's code
            torch.cuda.synchronize(self.device)
            logger.warning("CUDA graphs are off: this model's decode step cannot be captured (%s)", exc)
            return None
        return graphs


def build_shard(
    args: EngineArgs, described: ModelDescription, device: torch.device, tp: TensorParallel
) -> ModelShard:
    """This rank's shard, ready to step. Every rank runs the same collectives in the same order here
    (the profiling step, the pool size agreement, graph capture), so all of them call this."""
    shard = ModelShard(
        args, described.source, described.config, described.dtype, device, described.max_model_len
    )
    num_blocks = shard.size_kv_pool()
    # Rank 0's sizes: the pools must match, and the hot-block cache's blocks set where host block ids
    # start in the block tables every rank reads.
    num_blocks, shard.key_copy_slots, shard.hot_slots = tp.broadcast_object(
        (num_blocks, shard.key_copy_slots, shard.hot_slots)
    )
    shard.allocate(num_blocks)
    return shard
