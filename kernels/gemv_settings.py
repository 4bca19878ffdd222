"""Which kernel takes a one-row product, per device and weight shape: the skinny GEMV with a setting,
or cuBLAS.

No single setting of the skinny kernel is the fastest for every shape: on an H100 the setting
chosen on an H200 loses to cuBLAS on some wide projections (Phi-3-mini's qkv: 22.3 against 21.4 us)
where a tuned one wins (20.6), and a tuned setting beats it by 20-50% on small weights (Qwen3-30B-A3B's
o_proj 8.2 -> 6.7 us, its router 2.9 -> 1.7; docs/benchmarks/2026-12-06-gemv-settings-per-shape-h100.md).
`kernels/bench/bench_gemv.py --tune --write` measures, on the device at hand, cuBLAS and every
setting of the sweep for each projection shape of the served families, in CUDA graphs over weights
larger than L2, and records the fastest in gemv_tuned.json under the device's name. A device or
shape the file does not hold keeps the rule measured on an H200 before the table existed: the
default setting up to SKINNY_MAX_ROWS output rows, cuBLAS above. Only 2-byte weights follow the
table (bf16, fp16): its times are theirs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

TUNED_FILE = Path(__file__).with_name("gemv_tuned.json")
CUBLAS = "cublas"  # the table's word for "cuBLAS was faster at this shape"

# One row through a weight of at most this many output rows (any input width): where cuBLAS splits K
# and launches a reduction, the skinny kernel measured faster on an H200 (us in CUDA graphs: o_proj of
# an 8B model 10.0 against 13.2, down 4096 x 14336 30.6 against 32.1, 3072 x 4096 8.9 against
# 11.5; batch-1 decode 4.575 -> 4.482 ms a token with down added). Wider weights (qkv 6144 rows:
# 16.7 against 15.6; gate_up) stay cuBLAS's (docs/benchmarks/2026-11-30-sparse-wide-walk-h200.md).
SKINNY_MAX_ROWS = 4096


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


@functools.cache
def tuned_for(device_name: str) -> dict[str, dict | str]:
    """The file's entries for this device: shape key -> the skinny setting, or CUBLAS."""
    if not TUNED_FILE.exists():
        return {}
    return json.loads(TUNED_FILE.read_text()).get(device_name, {}).get("shapes", {})


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def setting_for_weight(weight: torch.Tensor) -> dict | None:
    """The skinny kernel's setting for one row through `weight` ({} is its default), or None where
    cuBLAS is the faster."""
    device = _device_name(weight.device.index or 0) if weight.is_cuda else None
    return setting_for(device, *weight.shape, weight.element_size())


def setting_for(device_name: str | None, n: int, k: int, element_size: int = 2) -> dict | None:
    """The table's choice for this device and an n x k weight, else the rule for untuned devices."""
    if device_name is not None and element_size == 2:
        entry = tuned_for(device_name).get(shape_key(n, k))
        if entry is not None:
            return None if entry == CUBLAS else dict(entry)
    return {} if n <= SKINNY_MAX_ROWS else None
