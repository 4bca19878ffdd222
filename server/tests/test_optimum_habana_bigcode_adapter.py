"""The tiny GPT-BigCode model driven through its fused multi-query cache adapter, token for token against
transformers `generate` (greedy, float32, CPU).

Seven prompts of 4 to 19 tokens with different budgets share three static rows of 24 positions, so
requests finish at different steps and are filtered out, waiting ones are inserted into the freed rows
(longer prompts shifting the batch right), and the batch shifts left when the used width reaches 24.
The same run drives the tiny Llama through the per-layer layout: the loop knows no layout. Each runs
twice: prompts at their own lengths, and left-padded to buckets of 8, 16 and 23 tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tgserve.server.loading.hf_compat import dtype_kwargs
from tgserve.server.optimum_habana.cache_layouts import FusedMultiQuery, PerLayerKV, layout_for_config
from tgserve.server.optimum_habana.static_batch import StaticBatchGenerator
from tgserve.server.testing.fixtures import CHECK_PROMPTS, fixture_path, single_threaded_torch

from .parity import reference_greedy

PROMPTS = [*CHECK_PROMPTS, "def fib(n):\n    return"]  # 7, 5, 7, 17, 19, 4 and 10 tokens
MAX_NEW_TOKENS = [9, 4, 12, 6, 5, 11, 8]
ROWS, MAX_LEN = 3, 24


@pytest.mark.parametrize("buckets", [None, (8, 16, 23)], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("arch", "layout_class"), [("gpt_bigcode", FusedMultiQuery), ("llama", PerLayerKV)])
def test_static_batch_matches_generate_token_for_token(
    arch: str, layout_class: type, buckets: tuple[int, ...] | None
) -> None:
    path = fixture_path(arch)
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", **dtype_kwargs(torch.float32)
    )
    config = model.config
    layout = layout_for_config(config)
    assert type(layout) is layout_class
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    with single_threaded_torch(), torch.no_grad():
        expected = [
            reference_greedy(model, p, m, config.eos_token_id) for p, m in zip(prompts, MAX_NEW_TOKENS)
        ]
        generator = StaticBatchGenerator(
            model, layout, ROWS, MAX_LEN, eos_token_id=config.eos_token_id, prompt_buckets=buckets
        )
        outputs = generator.generate(prompts, MAX_NEW_TOKENS)

    for index, (got, want) in enumerate(zip(outputs, expected)):
        assert got == want, f"request {index} ({len(prompts[index])} prompt tokens): {got} != {want}"
    assert sum(len(set(out)) for out in expected) > 20  # not a degenerate repeat of one token
    events = generator.events
    assert events["insert"] > ROWS, events  # some requests went into rows freed by filter
    assert events["filter"] >= 2 and events["shift_left"] >= 1 and events["shift_right"] >= 1, events
    assert not generator.running and not generator.cache.occupied().any()
    widths = {input_ids[1] for input_ids, _, cache_width in generator.batch.shapes.served if cache_width == 0}
    assert widths == (set(buckets) if buckets else {len(p) for p in prompts})
