"""The paged decode kernel's launch: its tiles, how many context splits, the splits' arrival counters,
and the merge the last split runs (`paged_decode._decode_kernel`)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import fold_sink, interpreting

MAX_AUTO_SPLITS = 64
GPU_BLOCK_N = 64  # keys a tile on a GPU; the interpreter takes 16 to stay fast
# Over an fp8 cache, tiles of 128 keys: a tile's scales are loaded a page's run at a time, and twice
# the keys a tile halve those rounds. On an H200 (32 heads, 8 KV heads of 128), a layer's decode at
# batch 1 and 1M tokens / batch 256 and 640 tokens: 64-key tiles 1,403 / 194 us, 128-key tiles
# 1,014 / 166, bf16's 1,081 / 159 (docs/benchmarks/2026-12-03-fp8-decode-and-1m-prefill-h200.md).
GPU_FP8_BLOCK_N = 128
# Over an fp8 cache, a launch with at least a (sequence, KV head) program per SM takes 64-key tiles
# and 2 warps: there the kernel is bound by the instructions that widen and scale each key, not by
# bytes, and more, smaller programs resident per SM hide their latency better. Fewer programs (split
# launches: small batches, long contexts) keep 128-key tiles and 4 warps. One layer on an H200 (32
# query / 8 KV heads of 128), us, 128-key x 4 warps / 64 x 2 (bf16): batch 256 x 515 tokens 151 /
# 127 (138), 256 x 640 157 / 141 (160), 64 x 4,096 218 / 196 (245), 32 x 16K 401 / 370 (490), 16 x
# 8K 136 / 128 (148), 4 x 2K 13.9 / 17.7 (18.0), 1 x 1M 771 / 1,098 (1,205). bf16 gains nothing from
# 2 warps (256 x 515: 149 against 138); docs/benchmarks/2026-12-04-fp8-decode-tiles-by-work-h200.md.
FP8_MANY_PROGRAMS_TILE = (64, 2)  # (keys a tile, warps)
FP8_FEW_PROGRAMS_TILE = (GPU_FP8_BLOCK_N, 4)


def _sm_count() -> int:
    return _sm_count_of(torch.cuda.current_device())


@functools.cache
def _sm_count_of(device_index: int) -> int:  # read once: choose_splits and fp8_tile ask every launch
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fp8_tile(num_seqs: int, num_kv_heads: int) -> tuple[int, int]:
    """(keys a tile, warps) of a decode launch over an fp8 cache on a GPU: fixed by the batch size, so
    a captured decode graph keeps one choice whatever the contexts it later replays with."""
    many = num_seqs * num_kv_heads >= _sm_count()
    return FP8_MANY_PROGRAMS_TILE if many else FP8_FEW_PROGRAMS_TILE


def choose_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int) -> int:
    """Enough context splits to give the GPU about two programs per SM, none shorter than 4 tiles."""
    if interpreting() or not torch.cuda.is_available():
        return 1
    want = triton.cdiv(2 * _sm_count(), max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context, 4 * block_n), MAX_AUTO_SPLITS))


def launch_tile(
    num_seqs: int, num_kv_heads: int, fp8: bool, decode_step: bool, block_n: int | None
) -> tuple[int, int]:
    """(keys a tile, warps): a caller's block_n with 4 warps, else by the cache's dtype and, for a
    decode step's launch over fp8, the work. Only decode steps (those that store the step's keys)
    follow the work: their kernels compile when start-up captures a decode graph per batch size. A
    prompt step's kept rows keep the few-programs tile, the kernel warm-up's prompts compile; by
    the work, a first step of 17 or more prompts paid a compile of 2-3 s on a fresh H200."""
    if block_n:
        return block_n, 4
    if interpreting():
        return 16, 4
    if not fp8:
        return GPU_BLOCK_N, 4
    return fp8_tile(num_seqs, num_kv_heads) if decode_step else FP8_FEW_PROGRAMS_TILE


def merge_tile(group: int, block_d: int) -> tuple[int, int]:
    """(heads, splits) of the merge's loads: the partials tile at most 8192 floats (64 registers a
    thread at 4 warps); a group's heads together where at least 4 splits still fit beside them.
    Independent of the split count (the merge masks the splits past it), so one kernel serves every
    count: a count-sized tile compiled a kernel per power of two, on first use."""
    rows = min(triton.next_power_of_2(group), max(1, 8192 // (4 * block_d)))
    return rows, min(MAX_AUTO_SPLITS, max(1, 8192 // (rows * block_d)))


# The split kernel's arrival counters: one int32 per (sequence, KV head), zero between launches.
# Allocated once per device and kept, so a CUDA graph captures a fixed address. Sizing: splits are
# only chosen (choose_splits) when num_seqs * num_kv_heads is below two programs per SM, under 300
# slots on an H200, so 8192 slots (32 KiB) cover every automatic launch and a forced num_splits up
# to, say, 256 sequences of 32 KV heads; a larger forced launch grows the buffer eagerly, and
# DecodeGraphs runs each batch size eagerly before capturing it, so capture finds it sized.
# Launches share these counters: correct because decode runs on one stream per device and two
# launches never overlap; kernels run concurrently on several streams would need buffers of their own.
_MIN_COUNTER_SLOTS = 8192
_counters: dict[torch.device, torch.Tensor] = {}
# Buffers replaced by a larger one stay alive: graphs captured before the growth still use them.
_retired_counters: list[torch.Tensor] = []


def split_counters(device: torch.device, slots: int) -> torch.Tensor:
    """The device's zeroed arrival counters, at least `slots` long (never allocated during capture)."""
    buf = _counters.get(device)
    if buf is not None and buf.numel() >= slots:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = 0 if buf is None else buf.numel()
        raise RuntimeError(
            f"paged_decode needs {slots} split counters on {device} but has {have}, and cannot allocate "
            "them while a CUDA graph is being captured: run the same launch eagerly before capturing"
        )
    if buf is not None:
        _retired_counters.append(buf)
    size = max(slots, _MIN_COUNTER_SLOTS, 0 if buf is None else 2 * buf.numel())
    _counters[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return _counters[device]


@triton.jit
def merge_splits(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    seq,
    head0,
    seq_slot0,
    stride_os,
    stride_oh,
    group,
    head_dim,
    num_splits,
    used,
    sinks_ptr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Combine the first `used` splits of a group's query heads: weights 2^(m_s - max) rescale each
    partial (the splits past them hold no context).

    MERGE_ROWS heads and BLOCK_S splits a load, the running max, sum and output carried from one
    load to the next, so a short context (few used splits) costs one L2 round trip, not one per
    split or per head. Loads are .cg: the partials were written by other SMs, and L1 is not
    coherent with them.
    """
    rows = tl.arange(0, MERGE_ROWS)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    for r0 in range(0, group, MERGE_ROWS):
        head = head0 + r0 + rows
        row_ok = r0 + rows < group
        m_run = tl.full([MERGE_ROWS], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([MERGE_ROWS], dtype=tl.float32)
        o_run = tl.zeros([MERGE_ROWS, BLOCK_D], dtype=tl.float32)
        for s0 in range(0, used, BLOCK_S):
            ok = row_ok[:, None] & (s0 + splits < used)[None, :]
            slot = (seq_slot0 + head[:, None]) * num_splits + s0 + splits[None, :]
            m = tl.load(part_ml_ptr + slot * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
            ll = tl.load(part_ml_ptr + slot * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o_ptrs = part_o_ptr + slot[:, :, None] * BLOCK_D + dims[None, None, :]
            o = tl.load(o_ptrs, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, tl.max(m, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing yet: every weight is 0
            w = tl.exp2(m - m_safe[:, None])
            carried = tl.exp2(m_run - m_safe)
            l_run = l_run * carried + tl.sum(w * ll, 1)
            o_run = o_run * carried[:, None] + tl.sum(o * w[:, :, None], 1)
            m_run = m_new
        if SINKS:
            o_run, l_run = fold_sink(o_run, m_run, l_run, tl.load(sinks_ptr + head, mask=row_ok, other=0.0))
        out = o_run / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
        out_ptrs = out_ptr + seq * stride_os + head[:, None] * stride_oh + dims[None, :]
        out_mask = row_ok[:, None] & (dims < head_dim)[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
