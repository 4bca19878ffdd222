"""`tgserve sparse-search` on the tiny fixture model: every layer's heads get a pattern, in a file
the engine's loader reads; a text too short for --tokens is refused by name."""

from __future__ import annotations

import json

import pytest

from tgserve.cli import main
from tgserve.kernels.sparse.config import load_sparse_config
from tgserve.server.loading.source import load_config, resolve_model
from tgserve.server.testing.fixtures import fixture_path


def test_search_writes_a_pattern_for_every_head(tmp_path, capsys):
    model = str(fixture_path("llama"))
    out = tmp_path / "sparse_attention.json"
    args = ["sparse-search", "--model-id", model, "--tokens", "384", "--budget", "96", "--out", str(out)]
    assert main([*args, "--device", "cpu", "--min-seq-len", "4096"]) == 0
    config = load_sparse_config(out)
    hf = load_config(resolve_model(model))
    assert config.min_seq_len == 4096
    assert sorted(config.layers) == list(range(hf.num_hidden_layers))
    for layer in config.layers:
        assert len(config.layers[layer]) == hf.num_attention_heads + 1  # each head, and the layer default
    searched = json.loads(out.read_text())["search"]
    assert searched["tokens"] == 384 and searched["text"] == "pydoc_data.topics"
    assert "written to" in capsys.readouterr().out


def test_a_text_shorter_than_the_tokens_asked_is_refused(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("only a few words")
    args = ["sparse-search", "--model-id", str(fixture_path("llama")), "--text", str(text), "--tokens", "512"]
    with pytest.raises(SystemExit, match="fewer than --tokens 512"):
        main([*args, "--out", str(tmp_path / "x.json"), "--device", "cpu"])


def test_evaluate_scores_a_pattern_file_on_other_text(tmp_path, capsys):
    model = str(fixture_path("llama"))
    out = tmp_path / "sparse_attention.json"
    common = ["--model-id", model, "--tokens", "384", "--budget", "96", "--device", "cpu"]
    assert main(["sparse-search", *common, "--out", str(out)]) == 0
    text = tmp_path / "other.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    written = out.read_text()
    assert main(["sparse-search", *common, "--text", str(text), "--evaluate", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "patterns evaluated" in printed and printed.count("\n| ") >= 3  # header and a row a layer
    assert out.read_text() == written  # evaluating writes nothing
