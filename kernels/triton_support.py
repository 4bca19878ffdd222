"""The Triton the CUDA kernels need, checked when the CUDA backend is chosen.

Without the check an older Triton (PyTorch 2.5's 3.1, say) fails deep inside the first kernel
import, with an error that names a Triton module rather than what to install.
"""

from __future__ import annotations

import re

# triton.knobs, host-side tensor descriptors (triton.tools.tensor_descriptor) and programmatic
# dependent launch are Triton 3.4's, the version PyTorch 2.8 pairs with. The GPU tests and the
# recorded benchmarks ran on PyTorch 2.11 with Triton 3.6.
MIN_TRITON = (3, 4)


def installed_triton() -> str | None:
    """The importable Triton's version (PyTorch's own builds may name the package otherwise)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def check_triton(version: str | None) -> None:
    """Raise a RuntimeError naming the version found and the one needed, if it falls short."""
    need = ".".join(map(str, MIN_TRITON))
    fix = f"install PyTorch >= 2.8 with its Triton, or `pip install 'tgserve[cuda]'` (triton>={need})"
    if version is None:
        raise RuntimeError(f"the CUDA backend needs Triton >= {need}, and none is installed: {fix}")
    if _major_minor(version) < MIN_TRITON:
        raise RuntimeError(f"the CUDA backend needs Triton >= {need}; this environment has {version}: {fix}")


def _major_minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise RuntimeError(f"cannot read Triton's version {version!r}")
    return int(found[1]), int(found[2])
