"""One parse of a GGUF file while a model loads, instead of three.

transformers reads a GGUF file from the start (`gguf.GGUFReader`, every metadata field built in
Python, the tokenizer's vocabulary and merges among them) once for the config, again for the
tokenizer and again for the weights, and while it maps the weights' names it rebuilds gguf's table
of tensor names for every submodule of the model (397 times for SmolLM2). On a 2-core AVX2 host the
default model (SmolLM2-135M, a 98 MB file) took 31-33 s to load offline and a server 35 s to be
ready, most of it those three parses and 397 tables; with them made once, 15-16 s and 18 s
(docs/benchmarks/2026-12-01-gguf-startup-and-suite-time-cpu.md).

Inside `parsed_once()` the reader of each file and the table of each architecture are made once and
handed out again. Both are only read by transformers (fields, tensor records, name lookups), and it
imports `GGUFReader` and `get_tensor_name_map` from gguf at each call (4.55 and 5.x alike), which is
where these stand in. Outside the block gguf is as it was, and the readers are dropped with it: their
parsed fields take about 150 MB of Python objects for SmolLM2, which a serving process has no
use for.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, gguf parses each file and builds each architecture's name table once."""
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing will read one
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
