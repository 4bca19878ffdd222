"""Public entry points: routing on CPU, dense-vs-sparse threshold, and import hygiene."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import torch

from tgserve.kernels import dispatch, reference
from tgserve.kernels.sparse.attention import sparse_prefill
from tgserve.kernels.sparse.config import HeadPattern, SparseConfig
from tgserve.kernels.testing import make_paged_batch


def test_importing_dispatch_does_not_import_triton(tmp_path):
    """Backends import dispatch on CPU too; Triton must stay unloaded until a CUDA call.

    Run outside the checkout: `-c` puts the working directory first on sys.path, where the bare
    tgserve/ folder would shadow an installed (or PYTHONPATH) tgserve that maps kernels/.
    """
    code = "import sys, tgserve.kernels.dispatch; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=tmp_path)  # fmt: skip
    assert result.stdout.strip() == "False"


def test_cpu_paths_are_the_references():
    batch = make_paged_batch([3, 1], [10, 7], 4, 2, 16, 4, seed=1)
    got = dispatch.paged_prefill(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc,
                                 batch.seq_lens, 0.25, 3, 5.0)  # fmt: skip
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc,
                                     batch.seq_lens, 0.25, 3, 5.0)  # fmt: skip
    assert torch.equal(got, want)
    decode = make_paged_batch([1, 1], [10, 7], 4, 2, 16, 4, seed=2)
    got = dispatch.paged_decode(
        decode.query, decode.kv_cache, decode.block_tables, decode.seq_lens, 0.25, 3, 5.0
    )
    want = reference.paged_attention(decode.query, decode.kv_cache, decode.block_tables, decode.query_start_loc,
                                     decode.seq_lens, 0.25, 3, 5.0)  # fmt: skip
    assert torch.equal(got, want)
    cache = torch.zeros_like(batch.kv_cache)
    dispatch.write_kv(batch.key, batch.value, cache, batch.slot_mapping)
    expected = torch.zeros_like(batch.kv_cache)
    reference.write_kv(batch.key, batch.value, expected, batch.slot_mapping)
    assert torch.equal(cache, expected)


def test_fresh_prefill_goes_sparse_only_above_the_threshold():
    gen = torch.Generator().manual_seed(2)
    starts = [0, 40, 240, 247]
    q = torch.randn(247, 4, 32, generator=gen)
    k, v = torch.randn(247, 2, 32, generator=gen), torch.randn(247, 2, 32, generator=gen)
    cu = torch.tensor(starts, dtype=torch.int32)
    pattern = HeadPattern("a_shape", sink=4, local=16)
    config = SparseConfig(default=pattern, min_seq_len=128, block=16)
    got = dispatch.fresh_prefill(q, k, v, cu, starts, 0.2, sparse=config, layer=0)
    dense = reference.varlen_attention(q, k, v, cu, 0.2)
    assert torch.allclose(got[:40], dense[:40], atol=1e-6) and torch.allclose(
        got[240:], dense[240:], atol=1e-6
    )
    want = sparse_prefill(q[40:240], k[40:240], v[40:240], 0.2, [pattern] * 4, block=16)
    assert torch.allclose(got[40:240], want, atol=1e-6)
    assert not torch.allclose(got[40:240], dense[40:240], atol=1e-3), "the long prompt must be sparse"
    # Sliding-window or softcapped layers stay dense whatever the length.
    windowed = dispatch.fresh_prefill(q, k, v, cu, starts, 0.2, sliding_window=50, sparse=config)
    assert torch.allclose(windowed, reference.varlen_attention(q, k, v, cu, 0.2, 50), atol=1e-6)


def test_a_prompt_past_range_max_len_is_estimated_without_the_range_block():
    """The engine's sparse step hands the prompt's length to the config: past range_max_len the
    rescue block chosen by the range is dropped, up to it the pattern runs as written."""
    gen = torch.Generator().manual_seed(4)
    n = 200
    q = torch.randn(n, 4, 32, generator=gen)
    k, v = torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen)
    cu, starts = torch.tensor([0, n], dtype=torch.int32), [0, n]
    pattern = HeadPattern("vertical_slash", vertical=8, slash=32, sink=4, local=16, rescue=3, rescue_range=1)
    outs = {}
    for limit in (n, n - 1):
        config = SparseConfig(default=pattern, min_seq_len=128, block=16, range_max_len=limit)
        outs[limit] = dispatch.fresh_prefill(q, k, v, cu, starts, 0.2, sparse=config, layer=0)
    with_range = sparse_prefill(q, k, v, 0.2, [pattern] * 4, block=16)
    without = sparse_prefill(q, k, v, 0.2, [pattern.without_range()] * 4, block=16)
    assert not torch.allclose(with_range, without, atol=1e-4), "the range block must matter here"
    assert torch.allclose(outs[n], with_range, atol=1e-6) and torch.allclose(outs[n - 1], without, atol=1e-6)


def test_a_prompt_in_the_tail_range_folds_in_its_skipped_blocks():
    """The engine's sparse step folds in the tail where the prompt's length is inside
    tail_min_len .. tail_max_len and the pattern leaves it unset; outside, it runs without."""
    gen = torch.Generator().manual_seed(5)
    n = 200
    q = torch.randn(n, 4, 32, generator=gen)
    k, v = torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen)
    cu, starts = torch.tensor([0, n], dtype=torch.int32), [0, n]
    pattern = HeadPattern("vertical_slash", vertical=8, slash=32, sink=4, local=16, rescue=1)
    outs = {}
    for low in (n, n + 1):
        config = SparseConfig(default=pattern, min_seq_len=128, block=16, tail_min_len=low)
        outs[low] = dispatch.fresh_prefill(q, k, v, cu, starts, 0.2, sparse=config, layer=0)
    with_tail = sparse_prefill(q, k, v, 0.2, [dataclasses.replace(pattern, tail=True)] * 4, block=16)
    without = sparse_prefill(q, k, v, 0.2, [dataclasses.replace(pattern, tail=False)] * 4, block=16)
    assert not torch.allclose(with_tail, without, atol=1e-4), "the tail must matter here"
    assert torch.allclose(outs[n], with_tail, atol=1e-6) and torch.allclose(outs[n + 1], without, atol=1e-6)


def test_skinny_path_takes_one_row_through_narrow_weights_only():
    """The rule for devices without a tuned table: weights of at most 4096 output rows (o_proj, down); qkv,
    gate_up and two rows stay cuBLAS's. On CPU, dispatch.linear is F.linear whatever the shape."""
    o_proj, qkv, gate_up = torch.empty(4096, 4096), torch.empty(6144, 4096), torch.empty(28672, 4096)

    def skinny(x, weight):
        return dispatch.one_row_setting(x, weight) is not None

    row, rows = torch.empty(1, 4096), torch.empty(2, 4096)
    assert skinny(row, o_proj)
    assert skinny(row, torch.empty(3072, 4096))  # qkv under two-way TP
    assert skinny(torch.empty(1, 14336), torch.empty(4096, 14336))  # down
    assert not skinny(row, qkv)
    assert not skinny(row, gate_up)
    assert not skinny(rows, o_proj)
    assert not skinny(torch.empty(4096, 2)[:, :1].t(), o_proj)  # strided row
    x, w, b = torch.randn(1, 8), torch.randn(3, 8), torch.randn(3)
    assert torch.equal(dispatch.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_sdpa_tries_flash_first_below_the_cudnn_length_and_cudnn_from_it():
    """cuDNN builds a plan for each new sequence length: only prompts long enough to repay it
    take cuDNN first; every backend stays in the list as a fallback."""
    from torch.nn.attention import SDPBackend

    short, long = dispatch.sdpa_backends(512), dispatch.sdpa_backends(dispatch.CUDNN_MIN_TOKENS)
    assert short[0] == SDPBackend.FLASH_ATTENTION
    assert dispatch.sdpa_backends(dispatch.CUDNN_MIN_TOKENS - 1)[0] == SDPBackend.FLASH_ATTENTION
    assert long[0] == SDPBackend.CUDNN_ATTENTION
    assert set(short) == set(long) == {SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                       SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH}  # fmt: skip


def test_programmatic_dependent_launch_is_off_for_cpu_tensors():
    """Kernels launched for CPU tensors (the interpreter) compile without the PDL waits."""
    from tgserve.kernels import triton_common

    assert triton_common.pdl(torch.zeros(1)) == {"PDL": False}


def test_programmatic_dependent_launch_can_be_turned_off(monkeypatch):
    """The engine's switch, not the environment, decides: off, no device is even asked."""
    from tgserve.kernels import triton_common

    monkeypatch.setattr(triton_common, "interpreting", lambda: False)
    monkeypatch.setattr(triton_common, "gdc_wait", object())
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, 0))
    try:
        triton_common.set_programmatic_dependent_launch(False)
        assert triton_common._pdl_on(0) is False and not asked
        triton_common.set_programmatic_dependent_launch(True)
        assert triton_common._pdl_on(0) is True and asked == [0]
    finally:
        triton_common.set_programmatic_dependent_launch(True)
        triton_common._pdl_on.cache_clear()
