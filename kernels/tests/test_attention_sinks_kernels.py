"""Learned attention sinks (gpt-oss) in the CUDA kernels: decode (one split and merged splits, a
window, a selection), paged prefill and varlen prefill, each against its twin with the sinks."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels import reference
from tgserve.kernels.paged_decode import paged_decode
from tgserve.kernels.paged_prefill import paged_prefill, varlen_prefill
from tgserve.kernels.testing import make_paged_batch, max_abs_err

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3}
# Large enough to take most of some rows' attention, small enough to leave others almost whole.
SINKS = torch.tensor([2.5, -1.0, 0.0, 4.0, 1.0, -3.0, 0.5, 6.0])


def _twin(batch, scale: float, window: int | None = None, sinks: torch.Tensor | None = SINKS) -> torch.Tensor:
    return reference.paged_attention(batch.query.cpu(), batch.kv_cache.cpu(), batch.block_tables.cpu(),
                                     batch.query_start_loc.cpu(), batch.seq_lens.cpu(), scale, window,
                                     sinks=sinks)  # fmt: skip


def _check(got: torch.Tensor, want: torch.Tensor, without: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all()
    assert max_abs_err(got.cpu(), want) <= ATOL[dtype]
    assert max_abs_err(want, without) > 10 * ATOL[dtype], "the sinks change the output"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 3), (5, 2)])
def test_decode_folds_each_heads_sink(device, dtype, window, splits):
    batch = make_paged_batch([1] * 4, [3, 16, 33, 50], 8, 2, 32, 8, dtype, device, seed=11)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.2, window, out=out,
                 num_splits=splits, sinks=SINKS.to(device))  # fmt: skip
    _check(out, _twin(batch, 0.2, window), _twin(batch, 0.2, window, None), dtype)


def test_selected_decode_folds_the_sinks(device):
    """Over chosen blocks (the twin: reference.selected_decode with the sinks)."""
    batch = make_paged_batch([1, 1], [40, 64], 8, 2, 32, 8, torch.float32, device, seed=12)
    chosen = torch.tensor(
        [[[0, 2], [1, 3]], [[4, 0], [2, 6]]]
    )  # 2 of each KV head's blocks, then its current one
    lengths = torch.tensor([24, 24], dtype=torch.int32)  # three blocks of 8
    args = (batch.block_tables.cpu(), batch.seq_lens.cpu(), chosen, lengths, 0.2)
    want = reference.selected_decode(batch.query.cpu(), batch.kv_cache.cpu(), *args, sinks=SINKS)
    out = paged_decode(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.2,
                       selection=(chosen.to(device), lengths.to(device)), sinks=SINKS.to(device))  # fmt: skip
    without = reference.selected_decode(batch.query.cpu(), batch.kv_cache.cpu(), *args)
    _check(out, want, without, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 4])
def test_paged_prefill_folds_each_heads_sink(device, dtype, window):
    # A fresh prompt, a chunk after a prefix hit, a decode row: one launch.
    batch = make_paged_batch([13, 6, 1], [13, 30, 9], 8, 2, 32, 8, dtype, device, seed=13)
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.2,
                  window, out=out, sinks=SINKS.to(device))  # fmt: skip
    _check(out, _twin(batch, 0.2, window), _twin(batch, 0.2, window, None), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_prefill_folds_each_heads_sink(device, dtype):
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(40, h, 32, generator=gen).to(dtype) for h in (8, 2, 2))
    cu = torch.tensor([0, 1, 17, 40], dtype=torch.int32)
    want = reference.varlen_attention(q, k, v, cu, 0.2, 6, sinks=SINKS)
    out = varlen_prefill(*(t.to(device) for t in (q, k, v, cu)), 0.2, 6, sinks=SINKS.to(device))
    _check(out, want, reference.varlen_attention(q, k, v, cu, 0.2, 6), dtype)
