"""Errors raised while finding and loading a model; each message names the file or limit involved."""


class ModelNotFoundError(FileNotFoundError):
    """The model id or path names nothing that exists locally or on the Hub."""


class ModelLoadError(RuntimeError):
    """The model exists but its files cannot be read (corrupt weights, pickle refused, bad config)."""
