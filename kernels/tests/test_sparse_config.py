"""Pattern configs: tgserve's JSON, MInference's JSON, defaults and errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tgserve.kernels.sparse.config import HeadPattern, load_sparse_config, parse_sparse_config


def test_default_config_is_vertical_slash_everywhere():
    config = load_sparse_config(None)
    patterns = config.head_patterns(layer=3, num_heads=4)
    assert patterns == [HeadPattern("vertical_slash", vertical=1000, slash=6096)] * 4
    assert config.min_seq_len == 32768 and config.block == 64 and config.last_q == 64


def test_tgserve_json_with_layer_and_head_overrides(tmp_path):
    data = {
        "min_seq_len": 8192,
        "default": {"kind": "vertical_slash", "vertical": 500},
        "layers": {
            "0": {"1": {"kind": "a_shape", "sink": 128, "local": 2048}},
            "2": {"default": {"kind": "block_sparse", "blocks": 50}, "0": {"kind": "dense"}},
        },
    }
    path = tmp_path / "patterns.json"
    path.write_text(json.dumps(data))
    config = load_sparse_config(path)
    assert config.min_seq_len == 8192
    layer0 = config.head_patterns(0, 3)
    assert layer0[0] == layer0[2] == HeadPattern("vertical_slash", vertical=500)
    assert layer0[1].kind == "a_shape" and (layer0[1].sink, layer0[1].local) == (128, 2048)
    layer2 = config.head_patterns(2, 2)
    assert layer2[0].kind == "dense" and layer2[1] == HeadPattern("block_sparse", vertical=500, blocks=50)
    assert config.head_patterns(7, 1) == [HeadPattern("vertical_slash", vertical=500)]


def test_minference_best_pattern_json():
    data = [
        {"0": ["vertical_and_slash", 1000, 6096, 0.96], "1": ["stream_llm", 100, 800, 0.5]},
        {"0": ["block_sparse", 0, 0, 0.9], "1": ["vertical_and_slash", 30, 800, 0.99]},
    ]
    config = parse_sparse_config(data)
    assert config.head_patterns(0, 2) == [
        HeadPattern("vertical_slash", vertical=1000, slash=6096),
        HeadPattern("a_shape", sink=100, local=800),
    ]
    assert config.head_patterns(1, 2)[0].kind == "block_sparse"
    assert config.head_patterns(1, 2)[1] == HeadPattern("vertical_slash", vertical=30, slash=800)


@pytest.mark.parametrize(
    "data",
    [
        {"default": {"kind": "diagonal"}},
        {"default": {"vertcal": 3}},
        {"default": {"slash": -1}},
        [{"0": ["x", 1, 1]}],
    ],
)
def test_bad_configs_are_rejected(data):
    with pytest.raises(ValueError):
        parse_sparse_config(data)


def test_rescue_by_range_is_at_most_the_rescue_blocks():
    """{"rescue": 0} means no rescue at all, the default's block by the range included."""
    config = parse_sparse_config(
        {"default": {"rescue": 0}, "layers": {"1": {"0": {"rescue": 1, "rescue_range": 2}}}}
    )
    assert (config.default.rescue, config.default.rescue_range) == (0, 0)
    assert (config.head_patterns(1, 1)[0].rescue, config.head_patterns(1, 1)[0].rescue_range) == (1, 1)
    assert (HeadPattern().rescue, HeadPattern().rescue_range) == (3, 1)


def test_prompts_past_range_max_len_drop_their_blocks_by_the_range():
    """Up to range_max_len a prompt keeps its patterns; past it each keeps only the rescue blocks
    chosen by the mean (the range pass would cost ~7 s of a 1M-token prompt's first token)."""
    config = parse_sparse_config(
        {
            "range_max_len": 1000,
            "layers": {"0": {"1": {"kind": "block_sparse", "rescue": 4, "rescue_range": 2}}},
        }
    )
    assert config.range_max_len == 1000
    written = [dataclasses.replace(p, tail=False) for p in config.head_patterns(0, 2)]  # 1000: no tail
    assert config.head_patterns(0, 2, seq_len=1000) == written
    short, long = config.head_patterns(0, 2, seq_len=1000), config.head_patterns(0, 2, seq_len=1001)
    assert [(p.rescue, p.rescue_range) for p in long] == [(2, 0), (2, 0)]
    assert [p.kind for p in long] == [p.kind for p in short] == ["vertical_slash", "block_sparse"]
    assert load_sparse_config(None).range_max_len == 524288


def test_the_tail_is_on_by_default_from_tail_min_len_to_tail_max_len():
    """A pattern that leaves the tail unset folds it in for prompts of 64K to 512K tokens (below,
    sparse only ties dense; above, it would add seconds to a 1M prompt's first token); a pattern
    that sets it keeps it at every length; the config file moves the range."""
    default = load_sparse_config(None)
    assert (default.tail_min_len, default.tail_max_len) == (65536, 524288)
    assert HeadPattern().tail is None and default.head_patterns(0, 1)[0].tail is None  # as written: off
    by_length = {n: default.head_patterns(0, 1, seq_len=n)[0].tail for n in (65535, 65536, 524288, 524289)}
    assert by_length == {65535: False, 65536: True, 524288: True, 524289: False}
    config = parse_sparse_config(
        {
            "tail_min_len": 100,
            "tail_max_len": 200,
            "layers": {"0": {"1": {"tail": False}, "2": {"tail": True}}},
        }
    )
    assert [p.tail for p in config.head_patterns(0, 3, seq_len=150)] == [True, False, True]
    assert [p.tail for p in config.head_patterns(0, 3, seq_len=201)] == [False, False, True]


def test_prompts_past_mean_keys_max_len_score_the_means_blocks_against_boxes():
    """Past mean_keys_max_len a "range-boxes" pattern scores its mean's blocks against boxes too
    (1M tokens: 33 against 125 ms a layer on an H100); "keys" stays keys at every length."""
    default = load_sparse_config(None)
    assert default.mean_keys_max_len == 524288 and HeadPattern().rescue_against == "range-boxes"
    by_length = {n: default.head_patterns(0, 1, seq_len=n)[0].rescue_against for n in (524288, 524289)}
    assert by_length == {524288: "range-boxes", 524289: "boxes"}
    config = parse_sparse_config(
        {"mean_keys_max_len": 100, "layers": {"0": {"1": {"rescue_against": "keys"}}}}
    )
    assert [p.rescue_against for p in config.head_patterns(0, 2, seq_len=101)] == ["boxes", "keys"]
    assert [p.rescue_against for p in config.head_patterns(0, 2, seq_len=100)] == ["range-boxes", "keys"]
