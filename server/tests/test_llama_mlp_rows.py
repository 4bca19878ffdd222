"""The llama MLP takes a long step's rows a slice at a time (bounded gate/up memory) and gives the
rows it would give all at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tgserve.server.models import llama


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_rows_in_slices_match_rows_at_once(act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimpleNamespace(
        model_type="llama", hidden_size=32, intermediate_size=48, hidden_act=act, mlp_bias=False
    )
    torch.manual_seed(0)
    mlp = llama.LlamaMLP(config)
    for param in mlp.parameters():
        param.data.normal_(0, 0.2)
    x = torch.randn(30, 32)
    at_once = mlp(x)
    monkeypatch.setattr(llama, "MLP_ROWS", 7)  # 30 rows: four slices of 7 and one of 2
    sliced = mlp(x)
    torch.testing.assert_close(sliced, at_once, rtol=1e-5, atol=1e-6)
    assert sliced.shape == (30, 32)
