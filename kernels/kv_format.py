"""The 8-bit KV cache's formats: each (token, KV head) row of keys or values stored with one float32
scale, set when the row is written, so no calibration is needed and nothing saturates.

- e4m3 (`--kv-cache-dtype fp8`): the row scaled so its largest magnitude is 448
  (`fp8_format.quantize_rows`); every element keeps its own exponent and three mantissa bits.
- int8 (`--kv-cache-dtype int8`): the row scaled so its largest magnitude is 127 and rounded to
  an integer, ties to even. Its step is the row's largest magnitude / 127 everywhere, finer than
  e4m3's (an eighth of each element) for all but the row's smallest elements. SmolLM2's greedy
  steps on the CPU (32 prompts x 32 steps): in float32, an int8 cache agrees with the full
  precision one on 1007/1024, an e4m3 one on 989; in bf16, with a bf16 cache on 999 and 974 (the
  bf16 engine with bf16 transformers: 1004). Keys carry the difference
  (docs/benchmarks/2026-12-05-issue-34-standing-and-rescue-costs.md). Those counts are without the
  full-precision tail, each sequence's current block kept in the model's dtype beside the pool
  (`server/kv_cache/tail_blocks.py`): with it, float32 1013 (int8) and 1003 (e4m3).

Both widen exactly to f16 in the kernels that read them. These are the torch twins of
`triton_common.scaled_kv_rows`, matched bit for bit.
"""

from __future__ import annotations

import torch

from tgserve.kernels.fp8_format import FP8, TINY_SCALE, quantize_rows

INT8 = torch.int8
INT8_MAX = 127.0
# A multiplication by the reciprocal, as fp8_format's INV_FP8_MAX: it rounds the same everywhere.
INV_INT8_MAX = 1.0 / INT8_MAX
SCALED_KV_DTYPES = (FP8, INT8)  # the cache dtypes that carry a scale a row


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit [T, H, D], float32 scale [T, H]) of keys or values x [T, H, D]: each head's row in
    `dtype` (e4m3 or int8) with its own scale."""
    rows = x.reshape(-1, x.shape[-1])
    if dtype == INT8:
        scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=TINY_SCALE) * INV_INT8_MAX
        q = torch.round(rows.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(INT8)
    elif dtype == FP8:
        q, scale = quantize_rows(rows)
    else:
        raise ValueError(f"no scaled KV format for {dtype}; the formats are {SCALED_KV_DTYPES}")
    return q.view(x.shape), scale.view(x.shape[:-1])


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., D]: 8-bit keys or values [..., D] times their scales [...]."""
    return q.float() * scale[..., None]
