"""KV writes by slot mapping: Triton kernel against the torch twin."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import reference
from tgserve.kernels.kv_write import write_kv
from tgserve.kernels.testing import to_device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (4, 32, 8), (2, 80, 5)])
def test_write_kv_matches_reference(device, dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 7, 19
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 18]] = -1  # padding / already-cached tokens must leave the cache untouched
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slots)
    got = cache.to(device)
    write_kv(key.to(device), value.to(device), got, slots.to(device))
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


def test_write_kv_int32_slots_and_strided_inputs(device):
    """Slots as int32 and keys that are views of a fused QKV projection (non-contiguous rows)."""
    qkv = torch.randn(6, 3, 2, 16)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, -1, 0, 9, 4, 11], dtype=torch.int32)
    cache = torch.zeros(2, 3, 4, 2, 16)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slots)
    got = cache.to(device)
    write_kv(to_device(key, device), to_device(value, device), got, slots.to(device))
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
