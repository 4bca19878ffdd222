"""Shared fixtures: the tiny byte-level BPE tokenizer of the test models, saved once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tgserve.server.testing.tiny_tokenizer import save_fast_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    save_fast_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    from tgserve.router.tokenization import RouterTokenizer

    return RouterTokenizer.from_directory(tokenizer_dir)
