"""`tgserve serve` flags: environment variables, precedence, and what reaches the engine."""

from __future__ import annotations

import argparse

import pytest

from tgserve.router import serve_args


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_args.add_serve_flags(parser, env or {})
    return parser.parse_args(argv)


def test_defaults_serve_the_default_model_on_tgi_port():
    args = parse([])
    assert args.model_id is None and args.port == 3000 and args.trust_remote_code is False


def test_environment_then_flag_precedence():
    env = {"MODEL_ID": "org/model", "PORT": "80", "MAX_INPUT_TOKENS": "100", "TRUST_REMOTE_CODE": "true"}
    args = parse([], env)
    assert (args.model_id, args.port, args.max_input_tokens, args.trust_remote_code) == (
        "org/model",
        80,
        100,
        True,
    )
    assert parse(["--port", "8080"], env).port == 8080


def test_old_tgi_spelling_is_accepted():
    assert parse(["--max-input-length", "7"]).max_input_tokens == 7
    assert parse([], {"MAX_INPUT_LENGTH": "9"}).max_input_tokens == 9


def test_bad_boolean_is_refused():
    with pytest.raises(argparse.ArgumentTypeError):
        serve_args.parse_bool("maybe")


def test_engine_args_pass_only_what_is_set():
    args = parse(["--max-batch-total-tokens", "1000", "--block-size", "16", "--max-batch-size", "8"])
    engine = serve_args.engine_args(args)
    assert engine["num_blocks"] == 63 and engine["max_num_seqs"] == 8
    assert "max_num_batched_tokens" not in engine and "tensor_parallel_size" not in engine
    assert serve_args.engine_args(parse(["--num-shard", "2"]))["tensor_parallel_size"] == 2
    assert "quantize" not in engine
    assert serve_args.engine_args(parse(["--quantize", "fp8"]))["quantize"] == "fp8"
    assert serve_args.engine_args(parse([], {"QUANTIZE": "fp8"}))["quantize"] == "fp8"


def test_router_config_from_flags():
    config = serve_args.router_config(parse(["--api-key", "k", "--cors-allow-origin", "a.com, b.com"]))
    assert config.api_key == "k" and config.cors_allow_origin == ("a.com", "b.com")
    assert serve_args.router_config(parse(["--api-key", ""])).api_key is None


def test_hub_cache_reaches_the_engine_environment():
    args = parse(["--huggingface-hub-cache", "/data/hub"])
    assert serve_args.engine_environment(args, {"HF_TOKEN": "t"}) == {
        "HF_TOKEN": "t",
        "HF_HUB_CACHE": "/data/hub",
    }


def test_tgi_gaudi_bucketing_variables_reach_the_engine_as_a_bucket_config():
    from tgserve.server.config.buckets import BucketConfig

    assert "static_shapes" not in serve_args.engine_args(parse([]))  # the engine decides: on HPUs only
    env = {"BATCH_BUCKET_SIZE": "16", "PAD_SEQUENCE_TO_MULTIPLE_OF": "256", "WARMUP_ENABLED": "false"}
    sent = serve_args.engine_args(parse([], env))["buckets"]
    assert BucketConfig(**sent) == BucketConfig(batch_step=16, token_step=256, warmup=False)
    assert serve_args.engine_args(parse([], env))["warm_up"] is False  # nor warm-up requests on CUDA
    assert "warm_up" not in serve_args.engine_args(parse([]))
    assert serve_args.engine_args(parse(["--static-shapes", "true"]))["static_shapes"] is True
    sent = serve_args.engine_args(parse(["--bucketing", "exponential", "--limit-hpu-graph", "true"]))[
        "buckets"
    ]
    assert BucketConfig(**sent) == BucketConfig(scheme="exponential", decode_graphs_only=True)


def test_the_deployment_switches_are_flags_with_their_variables():
    """COMPUTE_TYPE and TGSERVE_PDL are read here, with the other flags, and passed on as
    configuration: the router's config and the engine's arguments."""
    assert serve_args.router_config(parse([])).compute_type is None
    assert (
        serve_args.router_config(parse([], {"COMPUTE_TYPE": "gpu+optimized"})).compute_type == "gpu+optimized"
    )
    assert serve_args.engine_args(parse([]))["programmatic_dependent_launch"] is True
    assert serve_args.engine_args(parse([], {"TGSERVE_PDL": "0"}))["programmatic_dependent_launch"] is False
    flag = ["--programmatic-dependent-launch", "false"]
    assert serve_args.engine_args(parse(flag, {"TGSERVE_PDL": "1"}))["programmatic_dependent_launch"] is False
