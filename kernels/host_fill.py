"""Copy chosen (host block, KV head) pairs into device blocks: the hot-block cache's fill.

Selective decode over a context partly in the host tier reads each chosen host block over the link
(`paged_decode`'s HOST path). Decode queries move slowly, so the blocks chosen repeat from step to
step; the hot-block cache (`server/kv_cache/hot_blocks.py`) keeps the chosen ones in spare device
blocks, one KV head at a time, and decode reads them there from the next step on. This kernel
copies the step's newly admitted pairs: for each (KV head, pick) with a target, that head's keys
and values (and an fp8 cache's scales) of the source host block into the target device block.

Twin: `reference.fill_from_host`. One program a (KV head, pick); picks without a target (-1) copy
nothing, so the grid depends only on the step's shape (CUDA graphs capture it). Keys and values
are copied as bytes: one kernel for every cache dtype. The host rows are pinned memory that the
kernel reads in place (unified addressing, ~51 GB/s on an H200 at 4 KiB runs:
docs/benchmarks/2026-12-03-zero-copy-host-reads-h200.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fill_kernel(
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    hk_ptr,
    hv_ptr,
    hks_ptr,
    hvs_ptr,
    src_ptr,
    dst_ptr,
    stride_pick_head,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_h_block,
    stride_hs_block,
    row_bytes,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SCALED: tl.constexpr,
):
    head = tl.program_id(0)
    pick = tl.program_id(1)
    dst = tl.load(dst_ptr + head * stride_pick_head + pick)
    if dst >= 0:
        src = tl.load(src_ptr + head * stride_pick_head + pick)
        offs = tl.arange(0, BLOCK_SIZE)[:, None] * stride_c_off + tl.arange(0, BLOCK_B)[None, :]
        mask = (tl.arange(0, BLOCK_B) < row_bytes)[None, :]
        within = head * stride_c_head + offs
        to = dst * stride_c_block + within
        at = src * stride_h_block + within
        tl.store(k_ptr + to, tl.load(hk_ptr + at, mask=mask), mask=mask)
        tl.store(v_ptr + to, tl.load(hv_ptr + at, mask=mask), mask=mask)
        if SCALED:  # [blocks, KV heads, BLOCK_SIZE]: the head's scales are one run
            run = head * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            scale_to = dst * (num_kv_heads * BLOCK_SIZE) + run
            tl.store(ks_ptr + scale_to, tl.load(hks_ptr + src * stride_hs_block + run))
            tl.store(vs_ptr + scale_to, tl.load(hvs_ptr + src * stride_hs_block + run))


def fill_from_host(
    kv_cache: torch.Tensor,  # [2, blocks, block_size, num_kv_heads, head_dim]
    kv_scale: torch.Tensor | None,  # [2, blocks, num_kv_heads, block_size] float32, contiguous
    host_cache: torch.Tensor,  # [2, host_blocks, block_size, num_kv_heads, head_dim], strided by block
    host_scale: torch.Tensor | None,  # [2, host_blocks, num_kv_heads, block_size]
    sources: torch.Tensor,  # int64 [num_kv_heads, picks]: host blocks
    targets: torch.Tensor,  # int64 [num_kv_heads, picks]: device blocks, -1: nothing to copy
) -> None:
    """For every (head, pick) with a target, head `head` of host block sources[head, pick] into
    device block targets[head, pick]: keys, values and, for an fp8 cache, their scales."""
    num_kv_heads, picks = targets.shape
    if picks == 0:
        return
    assert sources.shape == targets.shape and sources.is_contiguous() and targets.is_contiguous()
    assert host_cache.stride()[2:] == kv_cache.stride()[2:] and (host_scale is None) == (kv_scale is None)
    device_bytes, host_bytes = kv_cache.view(torch.uint8), host_cache.view(torch.uint8)
    block_size, row_bytes = kv_cache.shape[2], device_bytes.shape[4]
    scales = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (targets, targets)  # unread unscaled
    host_scales = (host_scale[0], host_scale[1]) if host_scale is not None else scales
    _fill_kernel[(num_kv_heads, picks)](
        device_bytes[0], device_bytes[1], *scales, host_bytes[0], host_bytes[1], *host_scales, sources, targets,
        targets.stride(0), device_bytes.stride(1), device_bytes.stride(2), device_bytes.stride(3),
        host_bytes.stride(1), host_scales[0].stride(0), row_bytes, num_kv_heads,
        BLOCK_SIZE=block_size, BLOCK_B=triton.next_power_of_2(row_bytes), SCALED=kv_scale is not None,
    )  # fmt: skip
