"""Tensor parallelism: which shard of the model this process holds, and the collectives between shards.

Models read `tensor_parallel()` when they are built (as vLLM's layers read the parallel state), so
the same model file builds a whole model (one process, the default) or one rank's shard. With one
shard every collective is the identity and no torch.distributed call is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def split_evenly(total: int, shards: int, what: str) -> int:
    """One shard's share of `total` `what` (heads, features); ValueError naming both if it is not whole."""
    if total % shards:
        raise ValueError(f"{total} {what} cannot be split evenly across {shards} shards")
    return total // shards


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed process group of the shards (NCCL on CUDA)
    cpu_group: Any = None  # the same ranks over gloo, for host objects

    def divide(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, features); they must split evenly."""
        return split_evenly(total, self.world_size, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the shards, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (host objects, over the gloo group)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every shard's x side by side along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_current = TensorParallel()


def tensor_parallel() -> TensorParallel:
    return _current


# Every rank seeds its random generators alike, so that unseeded sampling, which each rank does from
# the same gathered logits, draws the same tokens everywhere and the runners' copies stay equal.
SHARD_SEED = 0


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, backend: str | None = None
) -> TensorParallel:
    """Join the shards' process group (NCCL on CUDA, gloo on CPU) and make it the current one."""
    global _current
    if world_size > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        _current = TensorParallel(rank, world_size, dist.group.WORLD, cpu_group)
        torch.manual_seed(SHARD_SEED)
    else:
        _current = TensorParallel()
    return _current


def shutdown_tensor_parallel() -> None:
    """Leave the shards' process group; models built afterwards are whole again."""
    global _current
    if _current.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _current = TensorParallel()
