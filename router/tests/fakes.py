"""Test doubles: an in-process stand-in for the engine client, and app construction around it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from tgserve.router.config import RouterConfig
from tgserve.router.engine_client import EngineItem
from tgserve.router.errors import EngineUnavailableError, ValidationError
from tgserve.router.generation import Admission, Generator
from tgserve.router.metrics import RouterMetrics
from tgserve.router.state import RouterState
from tgserve.router.tokenization import RouterTokenizer
from tgserve.server.protocol.messages import EngineReady
from tgserve.server.protocol.outputs import EngineStats, RequestOutput, TokenLogprob
from tgserve.server.protocol.params import SamplingParams

Script = Callable[[list[int], SamplingParams], list[int]]


class FakeEngineClient:
    """Generates a scripted list of tokens per request, one per tick, like the real client's queues."""

    def __init__(self, script: Script, eos_token_id: int, tick_s: float = 0.001):
        self.script = script
        self.eos_token_id = eos_token_id
        self.tick_s = tick_s
        self.queue_s = 0.0  # how long a request waits before it is scheduled
        self.queues: dict[str, asyncio.Queue[EngineItem]] = {}
        self.submitted: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.finished: list[tuple[str, str]] = []
        self.stats: EngineStats | None = EngineStats(0, 0, 100, 100, 0, 0, 0)
        self.dead_reason: str | None = None
        self.reject_with: str | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> asyncio.Queue[EngineItem]:
        if self.dead_reason is not None:
            raise EngineUnavailableError(f"the engine is unavailable: {self.dead_reason}")
        queue: asyncio.Queue[EngineItem] = asyncio.Queue()
        for request_id, prompt, params in requests:
            self.submitted.append((request_id, prompt, params))
            self.queues[request_id] = queue
            if self.reject_with is not None:
                queue.put_nowait(ValidationError(self.reject_with))
                continue
            task = asyncio.get_running_loop().create_task(self._produce(request_id, prompt, params, queue))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return queue

    async def _produce(
        self, request_id: str, prompt: list[int], params: SamplingParams, queue: asyncio.Queue[EngineItem]
    ) -> None:
        tokens = self.script(prompt, params)
        await asyncio.sleep(self.queue_s)
        scheduled_at = time.monotonic()
        for position, token in enumerate(tokens):
            await asyncio.sleep(self.tick_s)
            if request_id not in self.queues:
                return  # aborted or finished by the router
            count = position + 1
            eos = token == self.eos_token_id and not params.ignore_eos
            done = eos or count >= params.max_new_tokens or count == len(tokens)
            logprobs = None
            if params.logprobs is not None:
                top = [(token, -0.5), (token + 1, -1.5)][: params.logprobs]
                logprobs = [TokenLogprob(token, -0.5, top)]
            reason = ("eos_token" if eos else "length") if done else None
            queue.put_nowait(
                RequestOutput(
                    request_id,
                    [token],
                    logprobs,
                    done,
                    reason,
                    len(prompt),
                    0,
                    count,
                    scheduled_at=scheduled_at,
                )
            )
            if done:
                return

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.queues.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.queues.pop(request_id, None)
            self.aborted.append(request_id)

    def finish(self, request_id: str, reason: str) -> None:
        self.queues.pop(request_id, None)
        self.finished.append((request_id, reason))

    async def ping(self, timeout_s: float) -> bool:
        return self.dead_reason is None

    def fail(self, reason: str) -> None:
        self.dead_reason = reason
        error = EngineUnavailableError(f"the engine is unavailable: {reason}")
        for queue in {id(q): q for q in self.queues.values()}.values():
            queue.put_nowait(error)


def text_script(tokenizer: RouterTokenizer, text: str, eos_token_id: int) -> Script:
    """Every request generates `text`, then EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return lambda prompt, params: ids + [eos_token_id]


def make_state(
    tokenizer_dir: Path,
    client: FakeEngineClient,
    config: RouterConfig | None = None,
    max_model_len: int = 256,
) -> RouterState:
    tokenizer = RouterTokenizer.from_directory(tokenizer_dir)
    resolved = (config or RouterConfig()).resolve(max_model_len)
    metrics = RouterMetrics(lambda: (client.stats, 16))
    generator = Generator(client, tokenizer, metrics, Admission(resolved.max_concurrent_requests))  # type: ignore[arg-type]
    ready = EngineReady(
        model_id="tiny", max_model_len=max_model_len, eos_token_ids=[client.eos_token_id], pid=0
    )
    return RouterState(
        config=resolved,
        client=client,
        tokenizer=tokenizer,
        metrics=metrics,  # type: ignore[arg-type]
        generator=generator,
        engine=ready,
        model_name="tiny",
    )
