"""The static-shape runner on CPU: steps padded to buckets give the tokens of unpadded steps, for
every fixture architecture, and after warmup a mixed workload compiles no new shape.

The workload is the parity scenario: prompts of many lengths arriving at different steps, chunked
prefill, preemption and a prefix-cache hit, so that batch sizes rise and fall and decode, prefill
and mixed steps all occur. On Gaudi each new shape would be a graph compile; the CPU counts them.
"""

from __future__ import annotations

import pytest
import torch

from tgserve.server.config.buckets import BucketConfig
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.static_shapes.buckets import StaticShapes
from tgserve.server.static_shapes.padding import pad_step, step_shape
from tgserve.server.testing.fixtures import FIXTURE_ARCHITECTURES, fixture_path

from .parity import build_requests, run_engine

PROMPT_LENGTHS = [40, 12, 70, 25, 9, 50, 33, 30]
TIGHT = dict(max_num_batched_tokens=32, block_size=8, num_blocks=24, max_num_seqs=8, max_model_len=128)
BUCKETS = BucketConfig(token_step=16, batch_step=4, prefill_batch_step=2)


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def serve(
    arch: str, buckets: BucketConfig | None, device: str = "cpu", **overrides
) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine(
        EngineArgs(
            model=str(fixture_path(arch)),
            static_shapes=buckets is not None,
            buckets=buckets or BucketConfig(),
            device=device,
            dtype="float32",
            **{**TIGHT, **overrides},
        )
    )
    requests = build_requests(engine.vocab_size, PROMPT_LENGTHS)
    run_engine(engine, requests)
    return {r.request_id: r.output for r in requests}, engine


@pytest.mark.parametrize("arch", FIXTURE_ARCHITECTURES)
def test_bucketed_steps_give_the_tokens_of_unpadded_ones(arch: str) -> None:
    expected, plain = serve(arch, None)
    got, engine = serve(arch, BUCKETS)
    assert got == expected
    log = engine.shard.static_executor.log
    assert log.num_compiled == len(engine.shard.shapes.warmup_shapes())
    assert log.after_warmup == 0, f"serving compiled {log.after_warmup} shapes warmup had not"
    served = log.served
    assert any(s.decode for s in served) and any(not s.decode for s in served) and len(served) > 6
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and plain.stats().num_preemptions > 0


# Models whose decode step cannot be captured (test_cuda_engine.py says why) run every step eagerly.
NOT_CAPTURABLE = {"falcon"}


# On CUDA decode steps replay CUDA graphs captured per batch bucket (at start: none is captured
# later); other steps run padded to their buckets.
@pytest.mark.parametrize("arch", FIXTURE_ARCHITECTURES)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_GPU)])
def test_bucketed_steps_on_cuda_with_graphs(arch: str, device: str) -> None:
    expected, _ = serve(arch, None, device)
    got, engine = serve(arch, BUCKETS, device)
    assert got == expected
    assert engine.shard.static_executor.log.after_warmup == 0
    graphs = engine.shard.decode_graphs
    if arch in NOT_CAPTURABLE:
        assert graphs is None
        return
    assert graphs is not None and sorted(graphs.graphs) == engine.shard.shapes.decode_batch
    assert graphs.num_replays > 0


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_bucketed_steps_through_the_cuda_backend_on_cpu(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda backend's step logic (which path a step takes, the last layer's kept rows, what it
    reads of the block tables) over padded steps, on CPU tensors: its kernels fall back to their
    torch twins, so what the GPU test above finds as an illegal memory access fails here as an
    IndexError, on every run of the suite."""
    from tgserve.server.attention.cuda import CudaAttentionBackend
    from tgserve.server.engine import model_shard

    expected, _ = serve(arch, None)
    monkeypatch.setattr(
        model_shard,
        "attention_backend",
        lambda device, sparse, selection: CudaAttentionBackend(sparse, selection),
    )
    got, engine = serve(arch, BUCKETS, warm_up=True)  # as on a GPU: its lone prompt is a fresh step
    assert isinstance(engine.runner.forward.backend, CudaAttentionBackend)
    assert got == expected


def test_padding_keeps_real_rows_in_place_and_adds_nothing_attended() -> None:
    engine = LLMEngine(
        EngineArgs(
            model=str(fixture_path("llama")), static_shapes=True, buckets=BUCKETS, device="cpu", **TIGHT
        )
    )
    shapes: StaticShapes = engine.shard.shapes
    captured = []
    prepare = engine.runner._prepare_inputs
    engine.runner._prepare_inputs = lambda out: captured.append(prepare(out)) or captured[-1]
    for i, length in enumerate((20, 3, 7)):
        engine.add_request(f"r{i}", list(range(5, 5 + length)), _greedy(4))
    engine.step()  # a prefill step: 30 tokens of 3 sequences
    engine.step()  # a decode step of 3
    prefill, decode = captured
    for inputs in (prefill, decode):
        shape = step_shape(shapes, inputs)
        padded = pad_step(inputs, shape)
        meta, pmeta = inputs.metadata, padded.metadata
        real_tokens, real_seqs = inputs.input_ids.shape[0], meta.num_seqs
        assert padded.input_ids.shape[0] == shape.num_tokens and pmeta.num_seqs == shape.num_seqs
        assert torch.equal(padded.input_ids[:real_tokens], inputs.input_ids)
        assert torch.equal(pmeta.slot_mapping[:real_tokens], meta.slot_mapping)
        assert (pmeta.slot_mapping[real_tokens:] == -1).all()  # padding writes no KV
        assert pmeta.query_start_loc_cpu[: real_seqs + 1] == meta.query_start_loc_cpu
        width = pmeta.block_tables.shape[1]  # a fresh step keeps one column: its table is not read
        assert width == (1 if inputs is prefill else shape.num_blocks)
        kept = min(width, meta.block_tables.shape[1])
        assert torch.equal(pmeta.block_tables[:real_seqs, :kept], meta.block_tables[:, :kept])
        assert not pmeta.block_tables[:real_seqs, kept:].any()
        assert torch.equal(padded.logits_indices[: inputs.logits_indices.shape[0]], inputs.logits_indices)
    assert step_shape(shapes, decode).decode and not step_shape(shapes, prefill).decode
    # A prefill step's padding sequences hold no queries; a decode step's hold one each.
    prefill_meta = pad_step(prefill, step_shape(shapes, prefill)).metadata
    assert prefill_meta.seq_lens_cpu[3:] == [0] * (prefill_meta.num_seqs - 3)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
