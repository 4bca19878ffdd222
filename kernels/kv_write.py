"""Triton kernel: write a step's keys and values into the paged KV cache by slot mapping.

Twin: `reference.write_kv`. One program per token copies all of its KV heads; slot -1 (padding,
or a prefix-cache hit whose KV is already stored) is skipped without touching memory. Into an 8-bit
cache (e4m3 or int8, `kv_format`), each head's row is quantized on the way
(`triton_common.scaled_kv_rows`) and its scale stored beside it, in the pool's scale tensor; a
token whose block has a tail slot (`server/kv_cache/tail_blocks.py`) is stored there too, unquantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import pdl, scaled_kv_rows, wait_for_inputs


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_s_kv,
    num_kv_heads,
    head_dim,
    tail_ptr,
    tail_of_ptr,
    stride_t_kv,
    stride_t_slot,
    stride_t_off,
    stride_t_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALED: tl.constexpr = False,
    INT8: tl.constexpr = False,
    PDL: tl.constexpr = False,
    TAIL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    # int64: slot * strides overflows int32 for caches of more than 2^31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = cache_ptr + block * stride_c_block + offset * stride_c_off
        dst = dst + heads[:, None] * stride_c_head + dims[None, :]
        k = tl.load(
            key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0
        )
        v = tl.load(
            value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0
        )
        if TAIL:
            tail_slot = tl.load(tail_of_ptr + block).to(tl.int64)
            if tail_slot >= 0:
                at = tail_ptr + tail_slot * stride_t_slot + offset * stride_t_off
                at = at + heads[:, None] * stride_t_head + dims[None, :]
                tl.store(at, k.to(tail_ptr.dtype.element_ty), mask=mask)
                tl.store(at + stride_t_kv, v.to(tail_ptr.dtype.element_ty), mask=mask)
        if SCALED:  # the scales are [2, num_blocks, num_kv_heads, block_size], contiguous
            scale_dst = scale_ptr + (block * num_kv_heads + heads) * BLOCK_SIZE + offset
            k, k_scale = scaled_kv_rows(k.to(tl.float32), INT8)
            v, v_scale = scaled_kv_rows(v.to(tl.float32), INT8)
            tl.store(scale_dst, k_scale, mask=heads < num_kv_heads)
            tl.store(scale_dst + stride_s_kv, v_scale, mask=heads < num_kv_heads)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots of kv_cache (in place);
    with kv_scale [2, num_blocks, num_kv_heads, block_size] (contiguous), kv_cache is 8-bit (e4m3
    or int8) and each row's scale goes there; with tail (cache [2, slots, block_size,
    num_kv_heads, head_dim], slot_of int32 [num_blocks]), rows of blocks with a slot go there too."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # The last dimension must be unit-stride for the vectorised row copies.
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    assert kv_scale is None or kv_scale.is_contiguous()
    tail_cache, tail_of = tail or (kv_cache, slot_mapping)  # unread without TAIL
    assert tail_cache.stride(4) == 1
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        kv_cache if kv_scale is None else kv_scale,  # unread without SCALED
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        0 if kv_scale is None else kv_scale.stride(0),
        num_kv_heads,
        head_dim,
        tail_cache,
        tail_of,
        *tail_cache.stride()[:4],
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        SCALED=kv_scale is not None,
        INT8=kv_cache.dtype == torch.int8,
        TAIL=tail is not None,
        **pdl(key),
    )
