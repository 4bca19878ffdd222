"""Bucket schemes for static-shape devices: linear with a power-of-two ramp, exponential, lookups
that name the limit, and the warmup shape list. Plain Python: no torch."""

from __future__ import annotations

import pytest

from tgserve.server.static_shapes import StaticShapes, bucket_for, exponential_buckets, linear_buckets


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
    shapes = StaticShapes.from_limits(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096,
                                      block_size=16)  # fmt: skip
    assert shapes.decode_batch[-1] == 64 and shapes.decode_blocks[-1] == 256
    assert shapes.prefill_tokens == list(range(128, 2049, 128))
    assert shapes.decode_shape(9, 17) == (16, 24)
    assert shapes.prefill_shape(3, 700) == (4, 768)
    warmup = shapes.warmup_shapes()
    assert len(set(warmup)) == len(warmup)
    assert all(b * t <= 2048 or b == 1 for phase, b, t in warmup if phase == "prefill")
    assert ("decode", 64, 256) in warmup and ("decode", 1, 1) in warmup
    exponential = StaticShapes.from_limits(64, 2048, 4096, 16, scheme="exponential")
    assert exponential.decode_batch == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="scheme"):
        StaticShapes.from_limits(64, 2048, 4096, 16, scheme="cubic")
