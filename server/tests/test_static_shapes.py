"""Bucket schemes for static-shape devices: linear with a power-of-two ramp, exponential, lookups
that name the limit, and the warmup shape list. Plain Python: no torch."""

from __future__ import annotations

import pytest

from tgserve.server.config.buckets import BucketConfig
from tgserve.server.static_shapes.buckets import (
    StaticShapes,
    StepShape,
    bucket_for,
    exponential_buckets,
    linear_buckets,
)


def test_linear_ramps_up_in_powers_of_two_then_steps():
    assert linear_buckets(1, 8, 40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert linear_buckets(1, 8, 30) == [1, 2, 4, 8, 16, 24, 30]  # the maximum itself is a bucket
    assert linear_buckets(128, 128, 512) == [128, 256, 384, 512]
    assert linear_buckets(1, 8, 3) == [1, 2, 3]


def test_exponential_doubles_up_to_the_maximum():
    assert exponential_buckets(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert exponential_buckets(128, 1000) == [128, 256, 512, 1000]
    assert exponential_buckets(5, 5) == [5]


@pytest.mark.parametrize("bad", [(0, 8, 10), (4, 8, 2), (1, 0, 10)])
def test_bad_ranges_are_refused(bad):
    with pytest.raises(ValueError, match="bucket range"):
        linear_buckets(*bad)


def test_bucket_for_picks_the_smallest_that_holds_and_names_the_limit():
    buckets = [1, 2, 4, 8, 16]
    assert [bucket_for(buckets, n, "batch") for n in (1, 3, 4, 9, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match="batch of 17 exceeds the largest bucket, 16"):
        bucket_for(buckets, 17, "batch")


def test_shapes_from_the_engine_limits_cover_them():
    shapes = StaticShapes(BucketConfig(), max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096,
                          block_size=16)  # fmt: skip
    assert shapes.decode_batch[-1] == 64 and shapes.decode_blocks[-1] == 256
    assert shapes.prefill_tokens == list(range(128, 2049, 128))
    assert shapes.prefill_seqs == [1, 2, 4, *range(8, 65, 4)]
    # A decode step: one token and one logits row per sequence.
    assert shapes.shape_for(9, 9, 17, 9) == StepShape(True, 16, 16, 24, 16)
    # Anything else pads tokens and sequences; the block table takes the model's longest context.
    assert shapes.shape_for(700, 3, 5, 3) == StepShape(False, 768, 4, 256, 4)
    assert shapes.shape_for(700, 3, 5, 40).num_logits == 768  # prompt log-probabilities: every token
    with pytest.raises(ValueError, match="prefill tokens of 2049 exceeds the largest bucket, 2048"):
        shapes.shape_for(2049, 3, 5, 3)


def test_warmup_visits_every_shape_once_largest_first():
    shapes = StaticShapes(BucketConfig(token_step=16, batch_step=4, prefill_batch_step=2), 8, 32, 64, 8)
    warmup = shapes.warmup_shapes()
    assert len(set(warmup)) == len(warmup)
    prefill = [s for s in warmup if not s.decode]
    decode = [s for s in warmup if s.decode]
    assert {(s.num_tokens, s.num_seqs, s.num_blocks) for s in prefill} == {
        (t, n, w) for t in (16, 32) for n in (1, 2, 4, 6, 8) for w in (1, 8)
    }
    assert {(s.num_seqs, s.num_blocks) for s in decode} == {
        (b, w) for b in (1, 2, 4, 8) for w in (1, 2, 4, 6, 8)
    }
    assert warmup[0] == StepShape(False, 32, 8, 8, 8) and warmup[-1] == StepShape(True, 1, 1, 1, 1)
    # Every step the engine can schedule has a shape in the list.
    for tokens in range(1, 33):
        for seqs in range(1, min(tokens, 8) + 1):
            for blocks in range(1, 9):
                for logits in {seqs, seqs - 1} - {0}:  # a chunk that does not end its prompt samples nothing
                    for fresh in (True, False):
                        shape = shapes.shape_for(tokens, seqs, blocks, logits, fresh)
                        assert shape in warmup
                        assert shape.decode or shape.num_tokens > shape.num_seqs  # never a decode shape


def test_static_shapes_need_fewer_sequences_than_tokens_per_step():
    with pytest.raises(ValueError, match=r"fewer sequences per step \(64\) than tokens per step \(64\)"):
        StaticShapes(BucketConfig(), 64, 64, 4096, 16)


def test_schemes():
    exponential = StaticShapes(BucketConfig(scheme="exponential"), 64, 2048, 4096, 16)
    assert exponential.decode_batch == [1, 2, 4, 8, 16, 32, 64]
    assert exponential.prefill_tokens == [128, 256, 512, 1024, 2048]
    with pytest.raises(ValueError, match="scheme"):
        BucketConfig(scheme="cubic")
