"""The same workload through the engine in this process: no HTTP, no router, no second process.

The difference to the server run at the same concurrency is the cost of serving: HTTP, JSON, SSE,
the ZMQ hop, detokenization in the router.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from tgserve.router.bench.report import RequestTiming

if TYPE_CHECKING:
    from tgserve.server.engine.interface import Engine


def load_engine(model_id: str | None) -> Engine:
    from tgserve.server.config.engine_args import EngineArgs
    from tgserve.server.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=model_id))


def run_offline(
    engine: Engine, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list[RequestTiming], float]:
    """Keep `concurrency` requests in the engine, adding the next as one finishes; time every token."""
    from tgserve.server.protocol.params import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    timings = [RequestTiming(prompt_len=len(p)) for p in prompts]
    started: dict[str, tuple[int, float]] = {}
    queue = iter(enumerate(prompts))
    ids = itertools.count()
    start = time.perf_counter()

    def admit() -> None:
        for index, prompt in itertools.islice(queue, concurrency - len(started)):
            request_id = f"bench-{next(ids)}"
            engine.add_request(request_id, prompt, params)
            started[request_id] = (index, time.perf_counter())

    admit()
    while started:
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            index, began = started[output.request_id]
            timing = timings[index]
            if output.new_token_ids:
                timing.ttft = now - began if timing.ttft is None else timing.ttft
                timing.token_times.append(now - began)
                timing.output_tokens += len(output.new_token_ids)
            if output.finished:
                timing.latency = now - began
                del started[output.request_id]
        admit()
    return timings, time.perf_counter() - start
