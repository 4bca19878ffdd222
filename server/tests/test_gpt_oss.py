"""gpt-oss's MXFP4 experts (OpenAI's checkpoints): dequantized as transformers dequantizes them, and
a checkpoint of MXFP4 experts serves the tokens of the same experts written unquantized."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tgserve.server.engine.llm import LLM
from tgserve.server.models.gpt_oss import mxfp4_dequantized
from tgserve.server.protocol.params import SamplingParams
from tgserve.server.testing.arch_sweep import saved_tiny_model


def _mxfp4(gen: torch.Generator, *rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [*rows, columns / 32, 16] and scales [*rows, columns / 32] (2^-3 .. 2^1)."""
    blocks = torch.randint(0, 256, (*rows, columns // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(124, 129, (*rows, columns // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _mxfp4(torch.Generator().manual_seed(0), 3, 40, columns=96)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = mxfp4_dequantized(blocks, scales, torch.float32)  # [E, out, in]
    assert torch.equal(got.transpose(1, 2), want)


def test_a_checkpoint_of_mxfp4_experts_gives_the_tokens_of_the_same_experts_unquantized(tmp_path):
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    plain, packed = tmp_path / "plain", tmp_path / "mxfp4"
    model = saved_tiny_model("gpt_oss", "GptOssForCausalLM", plain, intermediate_size=64, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=6)  # fmt: skip
    experts, hidden, inter = 4, model.config.hidden_size, model.config.intermediate_size
    gen = torch.Generator().manual_seed(1)
    weights, quantized = load_file(plain / "model.safetensors"), {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, columns = (2 * inter, hidden) if name.endswith("gate_up_proj") else (hidden, inter)
        blocks, scales = _mxfp4(gen, experts, rows, columns=columns)
        # The plain checkpoint holds them as transformers dequantizes and writes them: [E, in, out].
        weights[name] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    save_file(weights, plain / "model.safetensors", metadata={"format": "pt"})
    packed.mkdir()
    for file in plain.iterdir():
        if file.name != "model.safetensors":
            (packed / file.name).write_bytes(file.read_bytes())
    rest = {n: t for n, t in weights.items() if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file(rest | quantized, packed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["self_attn", "router"],
    }
    (packed / "config.json").write_text(json.dumps(config))

    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=0)
    runs = []
    for directory in (plain, packed):
        llm = LLM(
            str(directory),
            dtype="float32",
            device="cpu",
            max_num_batched_tokens=8,
            block_size=8,
            num_blocks=64,
        )
        out = llm.generate([list(range(5, 22))], params)[0]
        runs.append((out.token_ids, [entry.logprob for entry in out.logprobs]))
    assert runs[0] == runs[1]
