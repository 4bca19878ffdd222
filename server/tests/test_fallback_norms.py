"""The transformers fallback's RMSNorms on tgserve's kernels (server/models/fallback_norms.py): each
transformers order finds its kernel, a norm of another formula keeps its own forward, and a swapped
model generates what transformers' own modules give."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from tgserve.kernels import dispatch
from tgserve.server.models.fallback_norms import KernelRMSNorm, matching_norm, swap_in_kernel_norms


def _with_weight(module: nn.Module, seed: int) -> nn.Module:
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return module


class EpsOutsideRMSNorm(nn.Module):
    """Another formula: epsilon added to the root, not under it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_transformers_order_finds_its_kernel(dtype):
    width = 64
    cases = [
        (LlamaRMSNorm(width, eps=1e-5), dispatch.rms_norm),
        # In float32 the cast is no step: OLMo's order is Llama's, and the first candidate wins.
        (
            Olmo2RMSNorm(width, eps=1e-6),
            dispatch.rms_norm if dtype == torch.float32 else dispatch.float_scaled_rms_norm,
        ),
        (Gemma2RMSNorm(width, eps=1e-6), dispatch.gemma_rms_norm),
    ]
    for seed, (module, entry) in enumerate(cases):
        module = _with_weight(module.to(dtype), seed)
        assert matching_norm(module, dtype) is entry, type(module).__name__
    assert matching_norm(EpsOutsideRMSNorm(width), dtype) is None
    assert matching_norm(nn.LayerNorm(width), dtype) is None, "not an RMSNorm"


def test_swapped_modules_keep_the_parameter_and_the_output():
    """The same Parameter object (state dict names unchanged) and, on the CPU, the same numbers."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = nn.ModuleList([Olmo2RMSNorm(32), EpsOutsideRMSNorm(32)])
            self.final = _with_weight(LlamaRMSNorm(32), 3)

    block = Block()
    _with_weight(block.norms[0], 4)
    x = torch.randn(5, 32)
    before = [m(x) for m in (block.norms[0], block.norms[1], block.final)]
    weight, names = block.final.weight, sorted(block.state_dict())
    assert swap_in_kernel_norms(block, torch.float32) == 2
    assert isinstance(block.norms[0], KernelRMSNorm) and isinstance(block.final, KernelRMSNorm)
    assert isinstance(block.norms[1], EpsOutsideRMSNorm)
    assert block.final.weight is weight and sorted(block.state_dict()) == names
    after = [m(x) for m in (block.norms[0], block.norms[1], block.final)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
