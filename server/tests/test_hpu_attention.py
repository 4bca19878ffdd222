"""The hpu attention backend against the torch reference twins (kernels/reference.py), on CPU.

The Habana boundary is replaced in one place: the backend is built with
`tgserve.server.testing.habana_stand_in.TorchStandInOps` (torch's SDPA standing in for FusedSDPA) instead of
`tgserve.server.device.habana.GaudiOps`; everything else is the backend's own code. The last test is the
same comparison on a real Gaudi with the real ops (`hpu`-marked, skipped elsewhere).

Each step is built twice: as the reference sees it (real sequences only, slot -1 never written) and
as the static-shape runner sends it (padding sequences, rows past the last sequence with slot -1, a
block table wider than needed or narrowed to the cached context). Outputs must agree on the real
rows, and the pools must be identical everywhere but the scratch block. Then the engine's static
runner, end to end, must give the cpu backend's tokens.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tgserve.kernels.reference import paged_attention, write_kv
from tgserve.server.attention.backend import AttentionLayerParams
from tgserve.server.attention.hpu import HpuAttentionBackend, hpu_step_plan
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.config.buckets import BucketConfig
from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.device import habana as ops
from tgserve.server.engine import model_shard
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.kv_cache.spec import KVCacheSpec
from tgserve.server.testing.fixtures import fixture_path
from tgserve.server.testing.habana_stand_in import TorchStandInOps

from .parity import build_requests, run_engine


@dataclass
class Step:
    """One step, as the reference gets it and padded as the hpu backend gets it."""

    query: torch.Tensor  # padded flat batch
    key: torch.Tensor
    value: torch.Tensor
    metadata: AttentionMetadata
    real_rows: torch.Tensor  # rows of the padded batch that are real tokens (they come first)
    pad_rows: torch.Tensor
    reference: AttentionMetadata  # real sequences only
    pool: torch.Tensor  # before the step; its last block is the scratch block


def _metadata(starts, seq_lens, tables, slots, block_size, width) -> AttentionMetadata:
    rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(rows, dtype=torch.int32).view(len(rows), width),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc_cpu=list(starts),
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )


def make_step(
    contexts: list[int],
    q_lens: list[int],
    heads: tuple[int, int],
    pad_seqs: int = 0,  # padding sequences, as static_shapes.padding pads: one token of a one-token context
    # (decode steps) or no token and no context (other steps)
    trailing: int = 0,  # rows past the last sequence
    width: int | str | None = None,  # block-table columns: a number, "context" (only the blocks cached
    # before this step, as a runner may narrow it) or None (one more than needed, as a bucket pads it)
    dim: int = 16,
    block_size: int = 4,
    seed: int = 0,
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv = heads
    num_blocks = sum(math.ceil(n / block_size) for n in contexts) + 3
    pool = torch.randn(2, num_blocks + 1, block_size, num_kv, dim, generator=gen)  # garbage everywhere
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # scattered blocks; the scratch block (the last) is never handed out
    tables = [[free.pop() for _ in range(math.ceil(n / block_size))] for n in contexts]

    def slot(table, p):
        return table[p // block_size] * block_size + p % block_size

    for table, n, ql in zip(tables, contexts, q_lens):  # earlier steps' keys and values
        earlier = torch.tensor([slot(table, p) for p in range(n - ql)], dtype=torch.long)
        write_kv(*torch.randn(2, n - ql, num_kv, dim, generator=gen), pool, earlier)

    decode = all(ql == 1 for ql in q_lens)
    num_real = sum(q_lens)
    rows = num_real + (pad_seqs if decode else 0) + trailing
    query = torch.randn(rows, num_heads, dim, generator=gen)
    key, value = torch.randn(2, rows, num_kv, dim, generator=gen)
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    slots = [slot(t, p) for t, n, ql in zip(tables, contexts, q_lens) for p in range(n - ql, n)]
    reference = _metadata(starts, contexts, tables, slots, block_size, max(len(t) for t in tables))
    pad_len = 1 if decode else 0
    padded_starts = starts + [starts[-1] + pad_len * (i + 1) for i in range(pad_seqs)]
    padded_lens = contexts + [pad_len] * pad_seqs
    slots += [-1] * (rows - num_real)
    if width == "context":
        width = max(math.ceil((n - ql) / block_size) for n, ql in zip(contexts, q_lens))
    elif width is None:
        width = max(len(t) for t in tables) + 1
    metadata = _metadata(padded_starts, padded_lens, tables + [[]] * pad_seqs, slots, block_size, width)
    real, pad = torch.arange(num_real), torch.arange(num_real, rows)
    return Step(query, key, value, metadata, real, pad, reference, pool)


def layer_params(heads, dim=16, window=None, softcap=None) -> AttentionLayerParams:
    return AttentionLayerParams(KVCacheSpec(heads[1], dim, torch.float32, window), dim**-0.5, softcap)


def expected(step: Step, layer: AttentionLayerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's output rows and pool after the step (real rows only, nothing else written)."""
    pool = step.pool.clone()
    rows = step.real_rows
    meta = step.reference
    write_kv(step.key[rows], step.value[rows], pool, meta.slot_mapping)
    out = paged_attention(
        step.query[rows],
        pool,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        layer.scale,
        layer.spec.sliding_window,
        layer.softcap,
    )
    return out, pool


def run_hpu(step: Step, layer: AttentionLayerParams, ops_: TorchStandInOps | None = None):
    pool = step.pool.clone()
    backend = HpuAttentionBackend(ops_ or TorchStandInOps())
    out = backend.forward(step.query, step.key, step.value, pool, backend.plan(step.metadata), layer)
    return out, pool


def check(step: Step, layer: AttentionLayerParams, ops_: TorchStandInOps | None = None) -> None:
    out, pool = run_hpu(step, layer, ops_)
    want, want_pool = expected(step, layer)
    assert out.shape == step.query.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out[step.real_rows], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[:, :-1], want_pool[:, :-1]), "a real KV slot differs from the reference"
    if len(step.pad_rows):  # padding went to the scratch slot (first slot of the last block)
        scratch = pool[0, -1, 0]
        assert any(torch.equal(scratch, step.key[r]) for r in step.pad_rows)


HEADS = [(4, 4), (8, 2), (8, 1)]  # MHA, GQA, MQA
WINDOW_SOFTCAP = [(None, None), (5, None), (None, 30.0), (7, 50.0)]


def fused_calls(softcap: float | None) -> int:
    return 1 if softcap is None else 0  # softcapped scores take the torch path (FusedSDPA has none)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_mixed_step_with_padding_matches_reference(heads, window, softcap):
    contexts = [1, 9, 17, 33, 16, 40, 5]
    q_lens = [1, 9, 1, 12, 1, 1, 5]  # fresh prompts, chunks after a prefix, decodes
    step = make_step(contexts, q_lens, heads, pad_seqs=2, trailing=3)
    stand_in = TorchStandInOps()
    check(step, layer_params(heads, window=window, softcap=softcap), stand_in)
    assert not hpu_step_plan(step.metadata).decode
    assert stand_in.calls["fused_sdpa"] == fused_calls(softcap)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_padded_decode_batch_matches_reference(heads, window, softcap):
    step = make_step([3, 8, 9, 30, 2], [1] * 5, heads, pad_seqs=3, seed=1)  # batch padded 5 -> 8
    stand_in = TorchStandInOps()
    check(step, layer_params(heads, window=window, softcap=softcap), stand_in)
    assert hpu_step_plan(step.metadata).decode
    assert stand_in.calls["fused_sdpa"] == 0


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("width", [None, "context"])
def test_fresh_prompts_go_through_fused_sdpa(heads, window, softcap, width):
    step = make_step([9, 3, 17], [9, 3, 17], heads, pad_seqs=1, trailing=5, width=width, seed=2)
    stand_in = TorchStandInOps()
    check(step, layer_params(heads, window=window, softcap=softcap), stand_in)
    assert stand_in.calls["fused_sdpa"] == fused_calls(softcap)
    assert stand_in.last_is_causal is (False if softcap is None else None)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("width", [None, "context"])
def test_lone_fresh_prompt(heads, window, width):
    """With nothing cached and no block-table columns, one prompt is plain causal: no mask at all."""
    step = make_step([11], [11], heads, trailing=5, width=width, seed=3)
    stand_in = TorchStandInOps()
    check(step, layer_params(heads, window=window), stand_in)
    assert stand_in.last_is_causal is (width == "context" and window is None)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("width", [None, "context"])
def test_chunks_after_cached_context_match(heads, window, softcap, width):
    # Contexts ending mid-block and on a block boundary; the context's last block holds this step's first keys.
    step = make_step([20, 37, 16, 9], [4, 16, 7, 9], heads, pad_seqs=2, trailing=6, width=width, seed=4)
    stand_in = TorchStandInOps()
    check(step, layer_params(heads, window=window, softcap=softcap), stand_in)
    assert stand_in.calls["fused_sdpa"] == fused_calls(softcap)


@pytest.mark.parametrize(
    "contexts,q_lens", [([10, 7, 12], [10, 7, 12]), ([10, 17, 12], [1, 5, 12]), ([4, 9], [1, 1])]
)
def test_padding_rows_change_no_real_row(contexts, q_lens):
    heads, layer = (8, 2), layer_params((8, 2), window=6)
    decode = all(ql == 1 for ql in q_lens)
    step = make_step(contexts, q_lens, heads, pad_seqs=2, trailing=0 if decode else 3, seed=5)
    out, pool = run_hpu(step, layer)
    pads = step.pad_rows
    for tensor in (step.query, step.key, step.value):
        tensor[pads] = torch.randn(len(pads), *tensor.shape[1:]) * 100
    out2, pool2 = run_hpu(step, layer)
    assert torch.equal(out[step.real_rows], out2[step.real_rows])
    assert torch.equal(pool[:, :-1], pool2[:, :-1])
    assert not torch.equal(pool[:, -1], pool2[:, -1])  # only the scratch block saw the new padding


def replayed(captured: Step, replay: Step) -> Step:
    """`replay`'s device tensors under `captured`'s host lists: what a graph recorded on `captured`
    would see when replayed with `replay`'s inputs."""
    meta = replay.metadata
    meta.query_start_loc_cpu = captured.metadata.query_start_loc_cpu
    meta.seq_lens_cpu = captured.metadata.seq_lens_cpu
    return replay


@pytest.mark.parametrize(
    "captured,replay",
    [
        (([5, 9, 17, 2], [1] * 4), ([14, 2, 11, 6], [1] * 4)),  # decode, other lengths
        (([9, 12, 6], [9, 12, 6]), ([20, 3, 4], [4, 3, 4])),  # fresh prompts, then chunks after a prefix
        (([9, 12, 6], [1, 4, 3]), ([14, 13, 8], [3, 1, 4])),  # mixed, rows moved between sequences
    ],
)
@pytest.mark.parametrize("window", [None, 5])
def test_host_lists_only_choose_the_shape(captured, replay, window):
    """Per-step numbers are read from device tensors: an HPU graph replays with stale host lists."""
    heads, layer = (8, 2), layer_params((8, 2), window=window)
    trailing = 0 if all(ql == 1 for ql in captured[1]) else 27 - sum(captured[1])
    first = make_step(*captured, heads, pad_seqs=1, trailing=trailing, width=6, seed=6)
    trailing = 0 if all(ql == 1 for ql in replay[1]) else 27 - sum(replay[1])
    second = make_step(*replay, heads, pad_seqs=1, trailing=trailing, width=6, seed=7)
    assert hpu_step_plan(first.metadata).shape_key == hpu_step_plan(second.metadata).shape_key
    check(replayed(first, second), layer)


ENGINE_LIMITS = dict(
    max_num_batched_tokens=32, block_size=8, num_blocks=24, max_num_seqs=8, max_model_len=128
)


def serve_scenario(arch: str, buckets: BucketConfig | None) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine(
        EngineArgs(
            model=str(fixture_path(arch)),
            static_shapes=buckets is not None,
            buckets=buckets or BucketConfig(),
            dtype="float32",
            **ENGINE_LIMITS,
        )
    )
    requests = build_requests(engine.vocab_size, [40, 12, 70, 25, 9, 50, 33, 30])
    run_engine(engine, requests)
    return {r.request_id: r.output for r in requests}, engine


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: softcap and alternating sliding windows
@pytest.mark.parametrize("decode_graphs_only", [False, True])  # LIMIT_HPU_GRAPH
def test_static_runner_with_the_hpu_backend_gives_the_cpu_tokens(arch, decode_graphs_only, monkeypatch):
    """The engine's static-shape runner (padded steps, chunked prefill, preemption, a prefix hit) on
    CPU with the hpu backend behind TorchStandInOps gives the cpu backend's greedy tokens. Its steps
    run as graph-wrapped step modules: TorchStandInOps' ShapeKeyedGraphs stands in for HPU graphs
    (a capture per new input shape, replays after); serving after warmup captures nothing."""
    expected, _ = serve_scenario(arch, None)
    stand_in = TorchStandInOps()
    monkeypatch.setattr(
        model_shard,
        "attention_backend",
        lambda device, sparse=None, selection=None: HpuAttentionBackend(stand_in),
    )
    buckets = BucketConfig(
        token_step=16, batch_step=4, prefill_batch_step=2, decode_graphs_only=decode_graphs_only
    )
    got, engine = serve_scenario(arch, buckets)
    assert got == expected
    assert engine.runner.forward.kv_caches[0].shape[1] > engine.num_blocks  # the scratch block
    assert stand_in.calls["fused_sdpa"] > 0 or arch == "gemma2"
    assert stand_in.calls["mark_step"] > 0  # after each forward and each sampling
    graphs, shapes = stand_in.graphs, engine.shard.shapes.warmup_shapes()
    graphed = [s for s in shapes if s.decode or not decode_graphs_only]
    # One capture per graphed warmup shape, none for shapes met later (there were none), replays while serving.
    assert stand_in.calls["wrap_in_hpu_graph"] == 1 and len(graphs.captured) == len(graphed)
    assert graphs.replays > 0 and engine.shard.static_executor.log.after_warmup == 0


def test_nothing_imports_habana_frameworks_at_import_time():
    """A finder that fails any import of habana_frameworks: it must not be reached by importing the
    backend and the boundary, nor by building the hpu backend through the factory."""
    code = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'habana_frameworks':
            raise AssertionError('imported ' + name)
sys.meta_path.insert(0, Refuse())
import torch
import tgserve.server.attention.hpu, tgserve.server.device.habana, tgserve.server.testing.habana_stand_in
from tgserve.server.attention.registry import attention_backend
backend = attention_backend(torch.device('hpu'))
assert type(backend).__name__ == 'HpuAttentionBackend' and backend.scratch_blocks == 1
assert type(backend.ops).__name__ == 'GaudiOps'
assert not [m for m in sys.modules if m.startswith('habana_frameworks')]
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.hpu
@pytest.mark.skipif(not ops.is_available(), reason="needs an Intel Gaudi HPU and habana_frameworks")
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0)])
def test_matches_reference_on_a_gaudi(window, softcap):
    """The same comparisons with the real GaudiOps (FusedSDPA) on an HPU, in float32."""
    device = torch.device("hpu")
    backend = HpuAttentionBackend(ops.GaudiOps())
    heads = (8, 2)
    layer = layer_params(heads, window=window, softcap=softcap)
    for contexts, q_lens in [([9, 3, 17], [9, 3, 17]), ([1, 9, 17, 33, 16], [1, 9, 1, 12, 1])]:
        step = make_step(contexts, q_lens, heads, pad_seqs=1, trailing=2, seed=8)
        want, want_pool = expected(step, layer)
        meta = step.metadata
        on_device = AttentionMetadata(
            query_start_loc=meta.query_start_loc.to(device),
            seq_lens=meta.seq_lens.to(device),
            block_tables=meta.block_tables.to(device),
            slot_mapping=meta.slot_mapping.to(device),
            query_start_loc_cpu=meta.query_start_loc_cpu,
            seq_lens_cpu=meta.seq_lens_cpu,
            block_size=meta.block_size,
        )
        pool = step.pool.to(device)
        q, k, v = (t.to(device) for t in (step.query, step.key, step.value))
        out = backend.forward(q, k, v, pool, backend.plan(on_device), layer)
        backend.ops.mark_step()
        torch.testing.assert_close(out.cpu()[step.real_rows], want, atol=2e-3, rtol=2e-3)
        assert torch.equal(pool.cpu()[:, :-1], want_pool[:, :-1])
