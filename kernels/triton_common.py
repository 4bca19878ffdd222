"""Triton building blocks shared by the attention kernels: scores, masking, online softmax."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

try:  # programmatic dependent launch (Hopper and later); older Triton has no device calls for it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the Triton version
    gdc_launch_dependents = gdc_wait = None

LOG2E = 1.4426950408889634


# fp8_format's constants, as Triton constants (the twins use the same float32 values).
E4M3_MAX = tl.constexpr(448.0)
INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)
INT8_MAX = tl.constexpr(127.0)  # kv_format's int8 constants
INV_INT8_MAX = tl.constexpr(1.0 / 127.0)
TINY_SCALE = tl.constexpr(1.1754943508222875e-38)
MAGIC_RINT = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it - it rounds |x| < 2^22 to an integer, ties to even


@triton.jit
def e4m3_rows(x):
    """x [R, D] float32 -> (q [R, D] float32 on e4m3's grid, scale [R]): each row divided by its
    scale, amax / 448 (`fp8_format.quantize_rows`, row by row), and rounded to the nearest e4m3
    value, ties to even, as torch's cast rounds. The rounding is done here, in float32, so the cast
    to e4m3 that follows is exact: the interpreter's own cast mis-rounds where rounding carries
    into the exponent (7.79 became 4.0, not 8.0), and compiled kernels then round as it does."""
    scale = tl.maximum(tl.max(tl.abs(x), 1), TINY_SCALE) * INV_E4M3_MAX
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX)
    # The grid's spacing at q: 2^(exponent - 3), and 2^-9 for the subnormals below 2^-6.
    exponent = tl.maximum(((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    inverse_spacing = ((130 - exponent) << 23).to(tl.float32, bitcast=True)
    spacing = ((124 + exponent) << 23).to(tl.float32, bitcast=True)
    q = ((q * inverse_spacing + MAGIC_RINT) - MAGIC_RINT) * spacing
    return q, scale


@triton.jit
def int8_rows(x):
    """x [R, D] float32 -> (q [R, D] float32 integers in [-127, 127], scale [R]): each row divided
    by amax / 127 and rounded to the nearest integer, ties to even (`kv_format.quantize_kv`)."""
    scale = tl.maximum(tl.max(tl.abs(x), 1), TINY_SCALE) * INV_INT8_MAX
    q = tl.math.div_rn(x, scale[:, None])
    q = (q + MAGIC_RINT) - MAGIC_RINT
    return tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX), scale


@triton.jit
def scaled_kv_rows(x, INT8: tl.constexpr):
    """x [R, D] float32 as an 8-bit KV cache stores its rows (INT8: int8, else e4m3): values on the
    format's grid in float32, to be cast to the cache's type exactly, and the scales."""
    if INT8:
        q, scale = int8_rows(x)
    else:
        q, scale = e4m3_rows(x)
    return q, scale


# Compiled kernels widen int8 through PTX (`widen_f16`); the interpreter runs none. Read at import,
# when triton.jit decides whether this module's kernels are interpreted.
WIDEN_INT8_BY_PTX = tl.constexpr(not triton.knobs.runtime.interpret)
# Four int8 bytes to four f16s: each byte offset by 128 (xor 0x80) and placed as the low mantissa
# byte of 1024.0 (0x64 high byte, by PRMT), where the mantissa's unit is 1, so the pair of f16s
# holds 1152 + x; one f16x2 subtraction of 1152 each pair then leaves x, exactly.
_INT8_TO_F16_PTX = tl.constexpr("""{
.reg .b32 biased, hi64, k1152;
xor.b32 biased, $2, 0x80808080;
mov.b32 hi64, 0x64646464;
prmt.b32 $0, biased, hi64, 0x5150;
prmt.b32 $1, biased, hi64, 0x5352;
mov.b32 k1152, 0x64806480;
sub.f16x2 $0, $0, k1152;
sub.f16x2 $1, $1, k1152;
}""")


@triton.jit
def widen_f16(x):
    """8-bit KV cache rows (e4m3 or int8) as f16, exactly. e4m3 widens in one conversion, two values
    an instruction; int8's conversion (I2F) issues at a fraction of that rate and bounded decode over
    an int8 cache: one layer on an H100, 256 x 640 tokens 192 us (e4m3 155), 1 x 128K 148 (114). With
    five instructions each four values, 157 and 116
    (docs/benchmarks/2026-12-05-int8-kv-on-cuda-h100.md)."""
    if x.dtype == tl.int8:
        if WIDEN_INT8_BY_PTX:
            return tl.inline_asm_elementwise(
                _INT8_TO_F16_PTX, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4
            )
    return x.to(tl.float16)


@triton.jit
def block_address(ptr, host_ptr, page, first, stride_block, stride_host_block, within, HOST: tl.constexpr):
    """Addresses of offset `within` of blocks `page` (tensors of one shape): in the device pool, or
    with HOST, for pages from `first` on, in host block page - first (the long-context tier's
    blocks, read where they lie: `HostKVPool.layer_views`, pinned memory on CUDA)."""
    at = ptr + page * stride_block + within
    if HOST:
        at = tl.where(page >= first, host_ptr + (page - first) * stride_host_block + within, at)
    return at


@triton.jit
def tanh(x):
    """tanh through exp: portable across Triton versions and the interpreter (saturates cleanly)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def fold_sink(acc, m_i, l_i, sink):
    """A learned attention sink (gpt-oss) folded into a finished flash state: one more key of zero
    value and logit `sink` [rows] (natural log; m_i is in base 2, as attend_tile keeps it)."""
    sink2 = sink * 1.4426950408889634
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.exp2(m_i - m_new)  # rows that saw no key: m_i = -inf, alpha 0
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink2 - m_new)


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    mask,
    sm_scale,
    softcap,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr = True,
    k_scale=None,
    v_scale=None,
):
    """One flash-attention step: fold the keys/values of a tile into the running (acc, max, sum).

    Scores are kept in base 2 (exp2 is the native instruction); m_i is the running max in that
    base. Rows that have seen no allowed key keep m_i = -inf, and the `m_safe` trick keeps them
    NaN-free so they end with acc = 0, l = 0. MASKED=False: every key of the tile is allowed to
    every row (`mask` is ignored): no select, no -inf guard, and the scale folds into the
    exponent (the sparse kernel's diagonal walk: 3% faster a layer on an H200 with TMA loads).
    k_scale [tile]: the keys' scales (an fp8 cache), applied to the scores, a column each.
    v_scale [tile]: the values' scales, applied to the probabilities ([rows, tile]) that weigh them.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if k_scale is not None:
        s = s * k_scale[None, :]
    qk_scale = sm_scale * 1.4426950408889634  # scores to base 2
    if not MASKED and not USE_SOFTCAP:
        # Every key allowed: each row's max is finite after this tile, so no -inf guard, and the
        # scale folds into the exponent's subtraction (one FMA per score).
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        weights = p if v_scale is None else p * v_scale[None, :]
        acc = tl.dot(weights.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return acc, m_new, l_i
    if USE_SOFTCAP:
        s = softcap * tanh(s * sm_scale / softcap) * 1.4426950408889634
    else:
        s = s * qk_scale  # one multiply per score
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # The rescaled accumulator feeds the second product (accumulated in the MMA, no separate add).
    weights = p if v_scale is None else p * v_scale[None, :]
    acc = tl.dot(weights.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL), a kernel may start while the kernel before it
    still runs: wait here until that kernel has finished and its writes are visible, then let the
    next kernel launch (it waits the same way, so the chain stays ordered). Before this call a
    kernel may only read what no recent kernel writes (weights) and write nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_pdl_wanted = True  # the engine's `programmatic_dependent_launch` (--programmatic-dependent-launch)


def set_programmatic_dependent_launch(enabled: bool) -> None:
    """Allow (the default) or forbid programmatic dependent launch for kernels launched from now on."""
    global _pdl_wanted
    _pdl_wanted = enabled
    _pdl_on.cache_clear()


def pdl(tensor: torch.Tensor) -> dict:
    """Launch arguments for a kernel that calls wait_for_inputs: programmatic dependent launch on
    CUDA devices of compute capability 9+ (its launch overlaps the previous kernel's tail: batch-1
    decode of Llama-3-8B's shape on an H200 went from 4.62 to 4.58 ms a token), off elsewhere and
    when `set_programmatic_dependent_launch(False)` was called."""
    if tensor.is_cuda and _pdl_on(tensor.device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if gdc_wait is None or interpreting() or not _pdl_wanted:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (TF32 would break the fp32 tests on GPU)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, minimum: int = 16) -> int:
    """Next power of two, at least `minimum` (tl.dot wants every dimension >= 16)."""
    return max(minimum, triton.next_power_of_2(n))


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests): kernels then use tiny tiles to stay fast."""
    return bool(triton.knobs.runtime.interpret)


# (kernel name, device index) -> the index of the first launch in its list that fitted there, kept
# only where it is not the first (so a changed first launch is always tried on a device it fits).
_fitting_launch: dict[tuple[str, int], int] = {}


def launch_fitting(
    name: str, device: torch.device, launches: Sequence[dict], run: Callable[[dict], None]
) -> None:
    """run(launch) with the first of `launches` whose kernel fits this GPU's shared memory.

    Launches are tuned on an H200 (227 KiB of shared memory a block); a GPU with less (A100 163 KiB,
    Ada 99 KiB) refuses a larger kernel when Triton loads it, before anything runs, with
    OutOfResources. The next launch is tried then, and the one that fitted is remembered.
    """
    key = (name, device.index if device.type == "cuda" and device.index is not None else -1)
    first = _fitting_launch.get(key, 0)
    for i in range(first, len(launches)):
        try:
            run(launches[i])
        except OutOfResources:
            if i == len(launches) - 1:
                raise
            continue
        if i:
            _fitting_launch[key] = i
        return
