"""--gpu-memory-utilization is this server's own share of the GPU, as in vLLM: what other processes
hold is not charged to it, and a share that is not free stops the server before it loads weights,
with an error that says who holds the memory."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from tgserve.server.execution.memory import GIB, DeviceAtStart, check_share_is_free


def test_a_free_share_passes():
    check_share_is_free(
        DeviceAtStart(free_bytes=100 * GIB, total_bytes=140 * GIB, held_outside_bytes=40 * GIB), 0.7
    )


def test_a_share_others_hold_names_them_and_the_way_out():
    start = DeviceAtStart(free_bytes=13 * GIB, total_bytes=140 * GIB, held_outside_bytes=127 * GIB)
    with pytest.raises(RuntimeError) as err:
        check_share_is_free(start, 0.9)
    message = str(err.value)
    assert "126.0 GiB of the GPU's 140.0 GiB" in message and "only 13.0 GiB are free" in message
    assert "other processes hold 127.0 GiB" in message and "--gpu-memory-utilization" in message


def test_what_this_process_holds_is_named_too():
    start = DeviceAtStart(
        free_bytes=20 * GIB, total_bytes=140 * GIB, held_outside_bytes=1 * GIB, allocated_bytes=119 * GIB
    )
    with pytest.raises(RuntimeError, match=r"other processes hold 1.0 GiB, this process 119.0 GiB\."):
        check_share_is_free(start, 0.5)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_a_share_outside_zero_to_one_is_refused(utilization):
    start = DeviceAtStart(free_bytes=140 * GIB, total_bytes=140 * GIB, held_outside_bytes=0)
    with pytest.raises(ValueError, match="must be in"):
        check_share_is_free(start, utilization)


# A second process that builds an engine at a 0.4 share, prints its pool size and holds the memory
# until its stdin closes.
HOLDER = """
import sys
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
engine = LLMEngine(EngineArgs(model=sys.argv[1], device="cuda", gpu_memory_utilization=0.4, cuda_graphs=False,
                              warm_up=False))
print(engine.num_blocks, flush=True)
sys.stdin.read()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_two_engines_share_one_gpu(tmp_path):
    from tgserve.server.config.engine_args import EngineArgs
    from tgserve.server.engine.llm_engine import LLMEngine
    from tgserve.server.testing.fixtures import fixture_path

    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests left cached in this process
    model = str(fixture_path("llama"))
    args = dict(model=model, device="cuda", cuda_graphs=False, warm_up=False)
    # cwd: away from the checkout, whose top-level tgserve/ folder is not the installed package
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, model],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        held_blocks = int(holder.stdout.readline())
        engine = LLMEngine(EngineArgs(gpu_memory_utilization=0.4, **args))
        # The holder's ~0.4 of the GPU is not charged to this engine: its pool is as large.
        assert engine.num_blocks >= 0.95 * held_blocks, (engine.num_blocks, held_blocks)
        with pytest.raises(RuntimeError, match="other processes hold"):
            LLMEngine(EngineArgs(gpu_memory_utilization=0.9, **args))
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
        engine = None
        gc.collect()
        torch.cuda.empty_cache()
