"""The engine's parts as the shard assembles them: which executor runs the steps, and the one
interface both engines present."""

from __future__ import annotations

import inspect

import pytest

from tgserve.server.config.buckets import BucketConfig
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.interface import Engine
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.execution.executor import EagerExecutor
from tgserve.server.optimum_habana.engine import StaticBatchEngine
from tgserve.server.static_shapes.executor import StaticShapeExecutor
from tgserve.server.testing.fixtures import fixture_path

TINY = dict(
    device="cpu", dtype="float32", block_size=8, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64
)


@pytest.mark.parametrize("static_shapes", [False, True])
def test_the_shard_chooses_one_executor_for_every_step(static_shapes: bool) -> None:
    """On the CPU: the forward as it is, or every step padded to its static shape (no graphs
    off CUDA); the runner holds the one the shard chose."""
    buckets = BucketConfig(token_step=16, batch_step=4, prefill_batch_step=2, warmup=False)
    engine = LLMEngine(
        EngineArgs(model=str(fixture_path("llama")), static_shapes=static_shapes, buckets=buckets, **TINY)
    )
    executor = engine.runner.executor
    assert type(executor) is (StaticShapeExecutor if static_shapes else EagerExecutor)
    assert engine.shard.decode_graphs is None
    assert (engine.shard.static_executor is executor) == static_shapes


@pytest.mark.parametrize("engine_class", [LLMEngine, StaticBatchEngine])
def test_both_engines_implement_the_engine_interface(engine_class: type) -> None:
    """Every method of `Engine`, with the same parameters, on both engines."""
    methods = [name for name, member in vars(Engine).items() if inspect.isfunction(member) and name[0] != "_"]
    assert {"add_request", "step", "abort_requests", "stats", "has_unfinished_requests"} <= set(methods)
    for name in methods:
        wanted = list(inspect.signature(getattr(Engine, name)).parameters)
        assert list(inspect.signature(getattr(engine_class, name)).parameters) == wanted, name
