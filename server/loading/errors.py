"""Errors raised while finding and loading a model; each message names the file or limit involved."""

from __future__ import annotations

from collections.abc import Collection


class ModelNotFoundError(FileNotFoundError):
    """The model id or path names nothing that exists locally or on the Hub."""


class ModelLoadError(RuntimeError):
    """The model exists but its files cannot be read (corrupt weights, pickle refused, bad config)."""


def refuse_missing_weights(class_name: str, path: str, missing: Collection[str]) -> None:
    """transformers initialises the weights a checkpoint lacks at random and only warns: served,
    such a model answers with noise (a multimodal checkpoint whose language model is stored under
    a prefix the loader does not map would lose all of them). Refused by name instead."""
    if missing:
        names = sorted(missing)
        raise ModelLoadError(
            f"checkpoint {path} lacks {len(names)} weights of {class_name}, e.g. {names[:3]}: "
            "the model would run with random weights there"
        )
