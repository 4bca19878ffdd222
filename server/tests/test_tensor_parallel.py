"""Tensor-parallel native models on CPU: two shards (two processes, gloo) compute the logits of the
unsharded model, for untied (llama) and tied, per-head-normed (qwen3) fixtures, Gemma 2 and Phi-3
(its fused checkpoint projections split per shard), and mixtures of experts (gpt-oss's among them)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from tgserve.server.attention.cpu import CpuAttentionBackend
from tgserve.server.engine.shard_workers import free_tcp_address
from tgserve.server.execution.forward import ModelForward
from tgserve.server.execution.memory import profiling_step
from tgserve.server.kv_cache.pool import allocate_kv_caches
from tgserve.server.kv_cache.spec import kv_cache_specs
from tgserve.server.loading.source import load_config, resolve_model
from tgserve.server.models.loader import load_model
from tgserve.server.testing.fixtures import fixture_path, write_fp8_checkpoint

NUM_TOKENS, NUM_PROMPTS = 31, 3  # fresh prompts of 11, 10 and 10 tokens in one flat batch


def prompt_logits(path: str, world_size: int = 1, quantize: str | None = None) -> torch.Tensor:
    """The last-position logits of each prompt, from this process's shard of the model."""
    source = resolve_model(path)
    config = load_config(source)
    model = load_model(source, config, torch.float32, torch.device("cpu"), quantize=quantize)
    attention = model.model.layers[0].self_attn
    assert attention.num_heads * world_size == config.num_attention_heads  # really a shard
    assert model.model.embed_tokens.weight.shape[0] == -(-config.vocab_size // world_size)
    specs = kv_cache_specs(config, torch.float32, world_size)
    forward = ModelForward(model, CpuAttentionBackend(), specs)
    forward.kv_caches = allocate_kv_caches(specs, 1, 8, torch.device("cpu"))
    step = profiling_step(NUM_TOKENS, NUM_PROMPTS, 8, torch.device("cpu"))
    ids = torch.arange(NUM_TOKENS) % 50 + 10
    return forward(ids, step.positions, step.metadata, step.logits_indices)


def _shard(rank: int, world_size: int, address: str, path: str, results, quantize: str | None = None) -> None:
    import torch.distributed as dist

    from tgserve.server.distributed.tensor_parallel import init_tensor_parallel, shutdown_tensor_parallel
    from tgserve.server.engine.shard_workers import exit_without_teardown

    init_tensor_parallel(rank, world_size, address, backend="gloo")
    results.put((rank, prompt_logits(path, world_size, quantize).numpy()))  # by value: the worker exits first
    dist.barrier()  # neither rank leaves while the other may still be receiving from it
    shutdown_tensor_parallel()
    results.close()
    results.join_thread()  # the logits are in the pipe
    exit_without_teardown()  # as the engine's workers end (it says why)


def sharded_logits(path: str, quantize: str | None = None) -> dict[int, torch.Tensor]:
    """Each rank's logits from two shards in two processes."""
    context = mp.get_context("spawn")
    results = context.Queue()
    address = free_tcp_address()
    workers = [
        context.Process(target=_shard, args=(r, 2, address, path, results, quantize)) for r in range(2)
    ]
    for worker in workers:
        worker.start()
    got = dict(results.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    return {rank: torch.from_numpy(logits) for rank, logits in got.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
def test_two_shards_compute_the_unsharded_logits(arch: str) -> None:
    path = str(fixture_path(arch))
    expected = prompt_logits(path)
    # Shards sum each row-parallel product in two halves: float32 rounds differently, and Gemma's
    # four norms a layer (weights near 3 in its fixture) carry that to ~1e-4 on logits up to ~12.
    tolerance = 5e-4 if arch == "gemma2" else 1e-5
    for logits in sharded_logits(path).values():
        torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)


def test_two_shards_of_gemma3_compute_the_unsharded_logits(tmp_path) -> None:
    """Gemma 3's text model (query/key norms, a RoPE per layer type), built tiny for the test."""
    from tgserve.server.testing.arch_sweep import saved_tiny_model

    layers = ["sliding_attention", "full_attention"]
    saved_tiny_model("gemma3_text", "Gemma3ForCausalLM", tmp_path, sliding_window=6, layer_types=layers)
    expected = prompt_logits(str(tmp_path))
    for logits in sharded_logits(str(tmp_path)).values():
        torch.testing.assert_close(logits, expected, atol=5e-4, rtol=5e-4)  # as Gemma 2's, four norms a layer


@pytest.mark.parametrize(
    "model_type,architecture,overrides",
    [("qwen2_moe", "Qwen2MoeForCausalLM", {"num_experts": 6, "num_experts_per_tok": 2, "decoder_sparse_step": 1}),
     ("mixtral", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2})],
)  # fmt: skip
def test_two_shards_of_a_mixture_of_experts_compute_the_unsharded_logits(
    tmp_path, model_type: str, architecture: str, overrides: dict
) -> None:
    """Each shard holds every expert's half of the intermediate size (and half the shared expert's)."""
    from tgserve.server.testing.arch_sweep import saved_tiny_model

    saved_tiny_model(model_type, architecture, tmp_path, **overrides)
    expected = prompt_logits(str(tmp_path))
    for logits in sharded_logits(str(tmp_path)).values():
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_two_shards_of_gpt_oss_compute_the_unsharded_logits(tmp_path) -> None:
    """Each shard its heads' sinks and its half of every expert's intermediate size (gate and up
    interleaved in the checkpoint), the down projection's bias added once."""
    from tgserve.server.testing.arch_sweep import saved_tiny_model

    model = saved_tiny_model("gpt_oss", "GptOssForCausalLM", tmp_path, sliding_window=6, intermediate_size=48,
                             num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                param.uniform_(-0.5, 1.0)
    model.save_pretrained(tmp_path)
    expected = prompt_logits(str(tmp_path))
    for logits in sharded_logits(str(tmp_path)).values():
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", ["--quantize fp8", "fp8 checkpoint"])
def test_two_fp8_shards_compute_close_to_one_fp8_model(source: str, tmp_path) -> None:
    """A row-parallel shard quantizes its own half of each activation row (and, under --quantize,
    of each weight row), so fp8 shards round differently from one fp8 model, at fp8's own scale: no
    closer to it than to the unquantized model, and no further. (A shard whose product missed its
    scales would be off by orders.) An fp8 checkpoint's scales are whole rows', split with nothing."""
    path = str(fixture_path("llama"))
    plain, fp8 = prompt_logits(path), prompt_logits(path, quantize="fp8")
    fp8_error = (fp8 - plain).abs().max()
    quantize = "fp8"
    if source == "fp8 checkpoint":
        path, quantize = str(write_fp8_checkpoint(fixture_path("llama"), tmp_path / "fp8", "channel")), None
        assert torch.equal(prompt_logits(path), fp8)  # the same weights as --quantize fp8's
    for logits in sharded_logits(path, quantize).values():
        assert (logits - fp8).abs().max() <= 2 * fp8_error
        assert (logits - plain).abs().max() <= 2 * fp8_error


def test_heads_that_do_not_split_evenly_are_named() -> None:
    config = load_config(resolve_model(str(fixture_path("llama"))))
    with pytest.raises(ValueError, match="2 KV heads cannot be split evenly across 4 shards"):
        kv_cache_specs(config, torch.float32, 4)


def test_an_engine_of_two_shards_generates_the_tokens_of_one() -> None:
    """Two CPU shards (the second a worker process) through the whole engine: chunked prefill,
    decode, greedy and seeded sampling give the tokens a single shard gives, with rank 0 waiting for
    each step's tokens and with it scheduling the next step first (async scheduling, as on GPUs;
    the worker launches each step before reading the last one's tokens either way), and after the
    engine's warm-up requests (on by default on GPUs)."""
    from tgserve.server.config.engine_args import EngineArgs
    from tgserve.server.engine.llm_engine import LLMEngine
    from tgserve.server.protocol.params import SamplingParams

    prompts = [list(range(10, 10 + n)) for n in (40, 7, 23)]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
    ]

    def generate(shards: int, async_scheduling: bool = False, warm_up: bool = False) -> dict[str, list[int]]:
        args = EngineArgs(model=str(fixture_path("llama")), max_num_batched_tokens=32, block_size=8,
                          num_blocks=64, tensor_parallel_size=shards,
                          async_scheduling=async_scheduling, warm_up=warm_up)  # fmt: skip
        engine = LLMEngine(args)
        try:
            outputs: dict[str, list[int]] = {}
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                engine.add_request(f"r{i}", prompt, p)
                outputs[f"r{i}"] = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outputs[out.request_id].extend(out.new_token_ids)
            return outputs
        finally:
            workers = list(engine.workers)
            engine.close()
            assert [w.exitcode for w in workers] == [0] * (shards - 1)

    one = generate(1)
    assert generate(2) == one
    assert generate(2, async_scheduling=True) == one
    assert generate(2, async_scheduling=True, warm_up=True) == one  # the workers step through it too


def test_an_architecture_without_tensor_parallel_layers_is_refused_by_name() -> None:
    import tgserve.server.distributed.tensor_parallel as distributed
    from tgserve.server.distributed.tensor_parallel import TensorParallel
    from tgserve.server.loading.errors import ModelLoadError

    source = resolve_model(str(fixture_path("gpt_bigcode")))
    previous = distributed._current
    distributed._current = TensorParallel(rank=0, world_size=2)  # as a rank of two would see it
    try:
        with pytest.raises(ModelLoadError, match="cannot be split across --num-shard 2"):
            load_model(source, load_config(source), torch.float32, torch.device("cpu"))
    finally:
        distributed._current = previous


def test_a_worker_dying_while_loading_stops_the_engine_at_once_saying_so() -> None:
    """Rank 0 waits for its workers in the process group's rendezvous (and later in collectives),
    where a dead worker would keep it until the group's 30-minute timeout. Here the worker process
    exits with code 3 before joining: the engine process must end within seconds, naming it."""
    script = f"""
import multiprocessing as mp, os
import tgserve.server.engine.llm_engine as engine

def start_dying(args, address):  # rank 1, which dies at once
    worker = mp.get_context("spawn").Process(target=os._exit, args=(3,), name="tgserve-shard-1")
    worker.start()
    return [worker]

engine.start_workers = start_dying
engine.LLMEngine(engine.EngineArgs(model={str(fixture_path("llama"))!r}, tensor_parallel_size=2, num_blocks=8))
print("the engine started without its worker")
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "shard worker tgserve-shard-1" in done.stderr and "exited with code 3" in done.stderr
    assert time.monotonic() - started < 60


def test_a_worker_dying_while_serving_fails_the_step_naming_it() -> None:
    """A collective with a dead worker fails as a reset connection (gloo): the step's error says
    which worker died. (The watch thread, which would end the process first, is left out here.)"""
    script = f"""
import os, signal
import tgserve.server.engine.shard_workers as shard_workers
shard_workers.WorkerWatch._watch = lambda self: None
import tgserve.server.engine.llm_engine as engine
from tgserve.server.protocol.params import SamplingParams

llm = engine.LLMEngine(engine.EngineArgs(model={str(fixture_path("llama"))!r}, tensor_parallel_size=2,
                                         num_blocks=64, block_size=8))
llm.add_request("r", list(range(10, 20)), SamplingParams(max_new_tokens=200, ignore_eos=True))
llm.step()
os.kill(llm.workers[0].pid, signal.SIGKILL)
try:
    while llm.has_unfinished_requests():
        llm.step()
    print("served without its worker")
except RuntimeError as exc:
    print("the step failed:", exc, flush=True)
os._exit(0)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "the step failed: shard worker tgserve-shard-1" in done.stdout, done.stdout + done.stderr
    assert "exited with code -9" in done.stdout
