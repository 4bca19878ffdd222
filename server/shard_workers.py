"""Worker processes for tensor-parallel ranks 1..N-1: each holds its shard and runs every step that
rank 0 (the engine) schedules.

Rank 0 broadcasts each `SchedulerOutput` over a gloo group (host objects never go through NCCL);
every rank's runner then prepares the same inputs, runs its shard (the collectives inside the model
keep them in step) and samples from the same gathered logits. All ranks seed their random
generators alike, so unseeded sampling draws the same tokens everywhere and the runners' copies of
each request stay equal. `None` ends the loop.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tgserve.server.distributed import TensorParallel, init_tensor_parallel, shutdown_tensor_parallel

if TYPE_CHECKING:
    from tgserve.server.engine import EngineArgs

logger = logging.getLogger(__name__)

SHARD_SEED = 0  # the same on every rank: see the module docstring


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def shard_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank on CUDA; every rank on the CPU otherwise."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return device


def start_workers(args: EngineArgs, init_method: str) -> list[mp.process.BaseProcess]:
    """Ranks 1..N-1, each in a spawned process (a fresh interpreter: no CUDA state inherited)."""
    context = mp.get_context("spawn")
    workers = [
        context.Process(
            target=worker_main, args=(rank, args, init_method), daemon=True, name=f"tgserve-shard-{rank}"
        )
        for rank in range(1, args.tensor_parallel_size)
    ]
    for worker in workers:
        worker.start()
    return workers


def broadcast(value: Any, tp: TensorParallel) -> Any:
    """Rank 0's `value` on every rank (host objects, over the gloo group)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def worker_main(rank: int, args: EngineArgs, init_method: str) -> None:
    from tgserve.server.engine import load_model_description
    from tgserve.server.model_shard import ModelShard

    tp = init_tensor_parallel(rank, args.tensor_parallel_size, init_method)
    torch.manual_seed(SHARD_SEED)
    described = load_model_description(args)
    device = shard_device(described.device, rank)
    shard = ModelShard(
        args, described.source, described.config, described.dtype, device, described.max_model_len
    )
    num_blocks = shard.size_kv_pool()
    num_blocks = broadcast(num_blocks, tp)  # rank 0's figure: the pools must match
    shard.allocate(num_blocks)
    while True:
        scheduler_output = broadcast(None, tp)
        if scheduler_output is None:
            break
        shard.runner.execute(scheduler_output)
    shutdown_tensor_parallel()
