"""Learned attention sinks (gpt-oss, GraniteMoE-SWA): a per-head logit of a key with a zero value in
every row's softmax, computed by the CPU backend through the transformers fallback (the CUDA
kernels' against their twins: kernels/tests/test_attention_sinks_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from tgserve.kernels.reference import masked_attention
from tgserve.server.models.gpt_oss import GptOssForCausalLM
from tgserve.server.models.hf_fallback import TransformersFallbackModel, refuse_unsupported_attention
from tgserve.server.models.registry import UnsupportedModelError
from tgserve.server.testing.arch_sweep import saved_tiny_model

from .test_native_families import engine_tokens, transformers_tokens

# gpt-oss, native: windowed layers among full ones, experts of an intermediate size other than the
# hidden size, two of four a token, a SwiGLU limit low enough to clamp random weights' activations.
GPT_OSS = dict(
    sliding_window=6, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0
)


@pytest.mark.parametrize(
    "model_type,architecture,native,overrides",
    [("gpt_oss", "GptOssForCausalLM", GptOssForCausalLM, GPT_OSS),
     ("granitemoe_swa", "GraniteMoeSWAForCausalLM", TransformersFallbackModel, {})],
)  # fmt: skip
def test_a_model_with_sinks_gives_transformers_tokens(tmp_path, model_type, architecture, native, overrides):
    """Chunked prefill, a prefix hit and decode, each with the sinks; they are large enough to
    matter (a test without them fails: the sweep's rows differ), as are the biases (transformers
    starts gpt-oss's experts' and router's at zero)."""
    model = saved_tiny_model(model_type, architecture, tmp_path, **overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.uniform_(-1.0, 3.0)
            elif name.endswith("bias"):
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path)
    got, want = engine_tokens(tmp_path, native), transformers_tokens(model)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want, strict=True):
        assert got_logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_a_sink_is_one_more_key_of_zero_value():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, 8, generator=gen) for h in (4, 2, 2))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    got = masked_attention(q, k, v, mask, 0.3, sinks=sinks)
    zero = torch.zeros(1, 2, 8)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 0.3
    scores = scores.masked_fill(~mask, float("-inf"))
    scores = torch.cat([scores, sinks[:, None, None].expand(4, 5, 1)], dim=-1)
    values = torch.cat([v, zero]).repeat_interleave(2, 1)  # [k + 1, H, d]
    want = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values)
    torch.testing.assert_close(got, want)


def test_sinks_are_refused_where_the_attention_does_not_compute_them(tmp_path):
    model = saved_tiny_model("gpt_oss", "GptOssForCausalLM", tmp_path)
    for device in ("cpu", "cuda"):
        refuse_unsupported_attention(model, torch.device(device))
    with pytest.raises(
        UnsupportedModelError, match="learned sinks .* runs on the CPU and CUDA backends only"
    ):
        refuse_unsupported_attention(model, torch.device("hpu"))
