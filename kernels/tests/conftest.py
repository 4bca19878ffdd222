"""Kernel tests run the Triton kernels on CPU through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before Triton is first imported: every @triton.jit, Triton's own
`tl.zeros` and friends included, picks interpreter or compiler when it is decorated. pytest loads
this conftest at start-up for `make test` (kernels/tests is a testpath) and for any run naming
this folder, before test modules are imported; the rest of the suite does not import Triton, and
the variable changes nothing but how Triton kernels run. Should Triton nevertheless have been
imported in compiled mode earlier in the process, the Triton tests skip with the reason instead
of failing obscurely. On a CUDA machine nothing is changed: the same tests run the compiled
kernels on the GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def _triton_runnable() -> bool:
    """False when Triton was imported in compiled mode on a machine that can only interpret."""
    if DEVICE == "cuda" or "triton" not in sys.modules:
        return True
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


@pytest.fixture
def device() -> str:
    """Where Triton kernel tests put their tensors: cuda when compiled kernels can run, else cpu."""
    if not _triton_runnable():
        pytest.skip("Triton was imported before TRITON_INTERPRET=1; run kernels/tests in its own process")
    return DEVICE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """gpu-marked kernel tests skip cleanly without CUDA (other folders are left alone)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and here in Path(item.path).parents:
            item.add_marker(skip)
