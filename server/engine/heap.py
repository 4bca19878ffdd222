"""The start-up heap kept out of the garbage collector's full passes.

After start-up the engine process holds millions of long-lived Python objects (the model's modules
and parameters, the tokenizer, compiled kernels, CUDA graphs, imported libraries). Each full
(generation-2) collection walks all of them: on an H200 the engine's took 260-270 ms, and a decode
step that met one stalled every running request for as long (one such step in the 256-request
benchmark, 4.78 s against 4.57 without it; docs/benchmarks/2026-12-04-gc-pauses-and-fp8-scales-h200.md). Freezing
moves what is alive at the end of start-up to a permanent generation that collections skip, as
vLLM's engine does; what serving creates is still collected.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(who: str) -> int:
    """Collect once, then freeze every object alive: call once, when start-up is complete. Returns
    how many objects were frozen (the cost of one full pass is logged beside it)."""
    start = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - start
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d start-up objects kept out of full garbage collections (one took %.0f ms)",
        who,
        frozen,
        seconds * 1e3,
    )
    return frozen
