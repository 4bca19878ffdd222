"""Sizing the KV pool on a GPU: whatever `gpu_memory_utilization` of the device leaves after the
weights, the peak activations of the largest step, and memory outside PyTorch (CUDA context, cuBLAS
workspaces), measured by running that largest step once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tgserve.server.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    weights_bytes: int  # allocated by PyTorch before the profiling step: weights and buffers
    activation_peak_bytes: int  # the profiling step's peak on top of that
    non_torch_bytes: int  # used on the device but not by PyTorch's allocator
    kv_budget_bytes: int

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"GPU memory: {self.total_bytes / gib:.1f} GiB total, weights {self.weights_bytes / gib:.2f} GiB, "
            f"activation peak {self.activation_peak_bytes / gib:.2f} GiB, outside PyTorch "
            f"{self.non_torch_bytes / gib:.2f} GiB, KV cache {self.kv_budget_bytes / gib:.2f} GiB"
        )


def dummy_prefill_metadata(
    num_tokens: int, num_seqs: int, block_size: int, device: torch.device
) -> AttentionMetadata:
    """`num_tokens` fresh prompt tokens over `num_seqs` sequences, writing nothing (slot -1). Every
    block-table entry names block 0, the placeholder cache's one block, so a backend that reads the
    cache during a prompt step (the last layer's kept rows on CUDA) stays inside it."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=torch.zeros(num_seqs, -(-max(lengths) // block_size), dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lengths,
        block_size=block_size,
    )


def profile_kv_budget(
    forward,  # (input_ids, positions, metadata, logits_indices) -> logits, over a placeholder KV cache
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    utilization: float,
    device: torch.device,
) -> MemoryProfile:
    """Run the largest prefill step the scheduler can produce and measure what it needs."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    metadata = dummy_prefill_metadata(num_tokens, num_seqs, block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in metadata.seq_lens_cpu])
    last = torch.tensor(metadata.query_start_loc_cpu[1:], device=device) - 1
    logits = forward(ids, positions, metadata, last)
    # The sampler works on a float32 copy of the logits, and log-softmaxes it for logprobs.
    torch.log_softmax(logits.float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    budget = int(total * utilization) - weights - peak - non_torch
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization}: weights take "
            f"{weights / 2**30:.2f} GiB and a {num_tokens}-token step {peak / 2**30:.2f} GiB of "
            f"{total / 2**30:.1f} GiB; lower --max-batch-prefill-tokens or raise the utilization"
        )
    del logits
    torch.cuda.empty_cache()
    return MemoryProfile(total, weights, peak, non_torch, budget)
