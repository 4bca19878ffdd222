"""Shared fixtures of the server tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tgserve.server.testing.fixtures import FIXTURE_ARCHITECTURES, fixture_path


@pytest.fixture(scope="session")
def tiny_model_paths() -> dict[str, Path]:
    """Architecture name -> directory of its tiny random-weight model, built once and cached on disk."""
    return {arch: fixture_path(arch) for arch in FIXTURE_ARCHITECTURES}
