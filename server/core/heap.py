"""The start-up heap kept out of the garbage collector's full passes.

After start-up a process holds many long-lived Python objects: the engine's model modules and
parameters, tokenizer, compiled kernels and CUDA graphs; the router's tokenizer, chat template and
app; the libraries both import. Each full (generation-2) collection walks all of them: on an H200
the engine's took 265-283 ms, and a decode step that met one stalled every running request for as
long (the 256-request benchmark: 4.87 s with such a step, 4.60 s frozen;
docs/benchmarks/2026-12-04-gc-pauses-and-fp8-scales-h200.md). Freezing moves what is alive at the
end of start-up to a permanent generation that collections skip, as vLLM's engine does; what
serving creates is still collected. The engine process, each shard worker and the router call it
once ready. Plain Python (the router imports it, and the router never imports torch).
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
