"""Sizing the KV pool on a GPU: whatever `gpu_memory_utilization` of the device leaves after the
weights, the peak activations of the largest step, and memory outside PyTorch (cuBLAS workspaces,
NCCL buffers), measured by running that largest step once.

The utilization is this server's own share of the device, as in vLLM: memory that other processes
held when it started is not charged to it, so two servers on one GPU can each take 0.45. A server
whose share is not free at start-up stops before loading its weights, saying who holds the rest.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from tgserve.server.execution.executor import Forward
from tgserve.server.execution.step_inputs import StepInputs, dummy_step

logger = logging.getLogger(__name__)


GIB = 1 << 30


@dataclass(frozen=True)
class DeviceAtStart:
    """The device when this server started, before it loaded anything."""

    free_bytes: int
    total_bytes: int
    held_outside_bytes: int  # not by this process's allocator: other processes, this CUDA context
    allocated_bytes: int = 0  # by this process's allocator already (another engine built in it)


def device_at_start(device: torch.device) -> DeviceAtStart:
    # An engine built and dropped earlier in this process (the offline API) may still sit in a
    # reference cycle, and its freed blocks in the allocator's cache: both go back first.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    held_outside = max(0, total - free - torch.cuda.memory_reserved(device))
    return DeviceAtStart(free, total, held_outside, torch.cuda.memory_allocated(device))


def check_share_is_free(start: DeviceAtStart, utilization: float) -> None:
    """Raise, naming the memory others hold, when this server's share of the device is not free."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    share = utilization * start.total_bytes
    if start.free_bytes < share:
        raise RuntimeError(
            f"gpu_memory_utilization={utilization} gives this server {share / GIB:.1f} GiB of the GPU's "
            f"{start.total_bytes / GIB:.1f} GiB, but only {start.free_bytes / GIB:.1f} GiB are free: other "
            f"processes hold {start.held_outside_bytes / GIB:.1f} GiB{_own_part(start)}. Lower "
            f"--gpu-memory-utilization (servers sharing a GPU each take their own share, 0.45 for two) or "
            f"free the GPU"
        )


def _own_part(start: DeviceAtStart) -> str:
    """What this process holds already (engines built before in it), when it holds anything."""
    return f", this process {start.allocated_bytes / GIB:.1f} GiB" if start.allocated_bytes else ""


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    weights_bytes: int  # allocated by PyTorch before the profiling step: weights and buffers
    activation_peak_bytes: int  # the profiling step's peak on top of that
    non_torch_bytes: int  # used on the device since start-up but not by PyTorch's allocator
    kv_budget_bytes: int
    held_outside_bytes: int = 0  # by other processes (and the CUDA context) at start-up, not charged

    def describe(self) -> str:
        return (
            f"GPU memory: {self.total_bytes / GIB:.1f} GiB total, weights {self.weights_bytes / GIB:.2f} GiB, "
            f"activation peak {self.activation_peak_bytes / GIB:.2f} GiB, outside PyTorch "
            f"{self.non_torch_bytes / GIB:.2f} GiB, KV cache {self.kv_budget_bytes / GIB:.2f} GiB "
            f"(other processes and the CUDA context: {self.held_outside_bytes / GIB:.2f} GiB)"
        )


def profiling_step(num_tokens: int, num_seqs: int, block_size: int, device: torch.device) -> StepInputs:
    """`num_tokens` fresh prompt tokens split evenly over `num_seqs` sequences, writing nothing:
    the largest step of a token budget, for the profile."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    return dummy_step(lengths, -(-max(lengths) // block_size), block_size, device)


def check_kv_budget(profile: MemoryProfile, num_tokens: int, utilization: float) -> MemoryProfile:
    """The profile of the largest `num_tokens`-token step, if it leaves memory for the KV cache."""
    if profile.kv_budget_bytes <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization}: of this server's "
            f"{profile.total_bytes * utilization / GIB:.1f} GiB, weights take {profile.weights_bytes / GIB:.2f} "
            f"GiB, a {num_tokens}-token step {profile.activation_peak_bytes / GIB:.2f} GiB and memory outside "
            f"PyTorch {profile.non_torch_bytes / GIB:.2f} GiB; lower --max-batch-prefill-tokens or raise the "
            "utilization"
        )
    return profile


def profile_step(
    forward: Forward,
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    utilization: float,
    device: torch.device,
    start: DeviceAtStart,
) -> MemoryProfile:
    """Run a prefill step of `num_tokens` tokens over `num_seqs` sequences and measure what it needs:
    the KV budget is what the weights and it leave of this server's share (zero or less when nothing
    is left: `check_kv_budget`). What was held at `start`, outside this process's allocator or inside
    it, is not charged to this engine; check_share_is_free has checked the utilization against it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    weights = before - start.allocated_bytes
    step = profiling_step(num_tokens, num_seqs, block_size, device)
    logits = forward(step.input_ids, step.positions, step.metadata, step.logits_indices)
    # The sampler works on a float32 copy of the logits, and log-softmaxes it for logprobs.
    torch.log_softmax(logits.float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device) - start.held_outside_bytes)
    budget = int(total * utilization) - weights - peak - non_torch
    del logits
    torch.cuda.empty_cache()
    return MemoryProfile(total, weights, peak, non_torch, budget, start.held_outside_bytes)
