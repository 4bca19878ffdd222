"""The transformers fallback's one-row projections on the skinny kernel
(server/models/fallback_linears.py): which modules are turned, what they keep, and that the CPU
computes exactly what it did; on CUDA a row through the kernel agrees with cuBLAS."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tgserve.server.models.fallback_linears import KernelLinear, swap_in_kernel_linears


class LoraLikeLinear(nn.Linear):
    """A subclass stands for quantized and adapter layers: its own forward must survive."""


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16, bias=False)
        self.adapter = LoraLikeLinear(16, 16)
        self.hooked = nn.Linear(16, 16)
        self.hooked._hf_hook = object()  # accelerate's offloading marker
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as transformers ties them

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.lm_head(self.hooked(self.adapter(self.down(torch.relu(self.up(x))))))


def test_plain_linears_are_turned_in_place_and_keep_everything():
    model = Tiny()
    ids = torch.tensor([[3, 7, 9], [1, 2, 4]])
    before = [model(ids), model(ids[:1, :1])]  # many rows, and the one row of a decode step
    names, tied = sorted(model.state_dict()), model.embed.weight
    assert swap_in_kernel_linears(model) == 3
    assert [type(m) for m in (model.up, model.down, model.lm_head)] == [KernelLinear] * 3
    assert type(model.adapter) is LoraLikeLinear and type(model.hooked) is nn.Linear
    assert isinstance(model.up, nn.Linear) and model.up.out_features == 24
    assert model.lm_head.weight is tied and sorted(model.state_dict()) == names
    after = [model(ids), model(ids[:1, :1])]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_weights_the_kernel_does_not_read_stay_as_they_are():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.float64))
    assert swap_in_kernel_linears(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_on_cuda_takes_the_kernel_and_agrees_with_cublas(bias):
    torch.manual_seed(1)
    linear = nn.Linear(512, 1024, bias=bias).to("cuda", torch.bfloat16)
    x = torch.randn(1, 1, 512, device="cuda", dtype=torch.bfloat16)
    many = torch.randn(3, 5, 512, device="cuda", dtype=torch.bfloat16)
    want = [linear(x), linear(many)]
    swap_in_kernel_linears(linear)
    got = [linear(x), linear(many)]
    assert got[0].shape == (1, 1, 1024)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(got[1], want[1]), "more than one row stays cuBLAS's"
