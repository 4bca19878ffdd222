"""Inputs for kernel tests and benchmarks: paged batches with scattered blocks, error metrics."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tgserve.kernels import reference
from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import quantize_kv


@dataclass
class PagedBatch:
    """A flat variable-length batch whose context KV sits in a paged cache, blocks shuffled."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's keys (already cached)
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    slot_mapping: torch.Tensor  # int64 [num_tokens]: this step's slots
    kv_scale: torch.Tensor | None = None  # [2, num_blocks, num_kv_heads, block_size]: an fp8 cache's scales


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random queries and a cache holding every sequence's full context at shuffled block ids.

    Unused cache entries are filled with NaN so that a kernel reading outside the context fails.
    """
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    width = max(per_seq + [1])
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    keys, values, slots = [], [], []
    for i, (q_len, n) in enumerate(zip(q_lens, seq_lens)):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        slot = tables[i, pos // block_size].long() * block_size + pos % block_size
        reference.write_kv(k, v, cache, slot)
        keys.append(k[n - q_len :])
        values.append(v[n - q_len :])
        slots.append(slot[n - q_len :])
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedBatch(
        query=query.to(device),
        key=torch.cat(keys).to(device),
        value=torch.cat(values).to(device),
        kv_cache=cache.to(device),
        block_tables=tables.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.cat(slots).to(device),
    )


def quantized_cache(cache: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache [2, blocks, block_size, heads, D] as an 8-bit pool stores it: e4m3 (or `dtype`,
    int8) values and one float32 scale a (token, KV head) row (`kv_format.quantize_kv`), the
    scales in the pool's layout [2, blocks, heads, block_size] (a page's run of a head contiguous)."""
    q, scale = quantize_kv(cache.reshape(-1, *cache.shape[-2:]), dtype)
    return q.view(cache.shape), scale.view(cache.shape[:-1]).transpose(2, 3).contiguous()


def with_8_bit_cache(batch: PagedBatch, dtype: torch.dtype = FP8) -> PagedBatch:
    """The batch with its cache quantized as an 8-bit pool stores it (`quantized_cache`). The unused
    entries' NaN poison carries over (a NaN row gets a NaN scale)."""
    kv_cache, kv_scale = quantized_cache(batch.kv_cache, dtype)
    return replace(batch, kv_cache=kv_cache, kv_scale=kv_scale)


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """t on device with its strides kept, the memory between its elements NaN where the dtype has
    one. `Tensor.to` gives a strided view's copy contiguous strides, so a test of a kernel on views
    (a fused QKV projection's parts, a row slice) would test contiguous inputs on a GPU; on the CPU
    it returns the view itself, whose gaps hold real numbers that a stray read would not show."""
    if t.numel() == 0 or 0 in t.stride():  # nothing to keep, or a broadcast view (copy_ refuses overlap)
        return t.to(device)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    fill = float("nan") if t.is_floating_point() else 0
    storage = torch.full((extent,), fill, device=device).to(t.dtype)
    return storage.as_strided(t.shape, t.stride()).copy_(t)


# The kernels against their twins on the same 8-bit cache: both dequantize the same bytes with the
# same scales, so they differ only as the dense kernels do (summation order, fp16 products).
EIGHT_BIT_ATOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def eight_bit_reference(
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The torch twin's attention over the batch's 8-bit cache, on the CPU (with `tail`, each
    sequence's current block read from its slot: `reference.current_block_from_tail`)."""
    return reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), batch.block_tables.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), scale, window, softcap,
                                     kv_scale=batch.kv_scale.cpu(), tail=tail)  # fmt: skip


def check_eight_bit(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """A kernel's output against `eight_bit_reference`: every row written and finite, within
    EIGHT_BIT_ATOL."""
    assert torch.isfinite(got).all(), "rows left unwritten, or a read outside the context"
    assert max_abs_err(got.cpu(), want) <= EIGHT_BIT_ATOL[dtype]


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference, in float32."""
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def compiled_kernel_name(fn: object) -> str:
    """The kernel's name from what Triton's `knobs.runtime.jit_cache_hook` passes as `fn`."""
    return getattr(getattr(fn, "fn", None), "__name__", None) or getattr(fn, "name", "?")
