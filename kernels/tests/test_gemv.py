"""The skinny linear kernel against F.linear: one to a few rows, bias, ragged shapes, strided rows."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tgserve.kernels import gemv_settings
from tgserve.kernels.gemv import skinny_linear
from tgserve.kernels.testing import max_abs_err, to_device

ATOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(50, 100), (4, 1030), (33, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(device, dtype, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x, w, b)
    got = skinny_linear(x.to(dtype).to(device), w.to(dtype).to(device), None if b is None else b.to(dtype).to(device),
                        config={"BLOCK_K": 64})  # fmt: skip
    assert got.dtype == dtype and got.shape == (rows, n)
    assert max_abs_err(got.float().cpu(), want) <= ATOL[dtype]


def test_strided_rows_and_default_config(device):
    """A row of a wider activation (a view), through the default tile sizes."""
    gen = torch.Generator().manual_seed(5)
    wide, w = torch.randn(1, 300, generator=gen), torch.randn(70, 200, generator=gen)
    x = wide[:, 50:250]
    assert max_abs_err(skinny_linear(to_device(x, device), w.to(device)).cpu(), F.linear(x, w)) <= 1e-4


def test_tuned_settings_choose_per_device_and_shape(monkeypatch, tmp_path):
    """A measured shape follows the table (a setting, or cuBLAS), on that device and in 2-byte
    dtypes only; anything else keeps the rule for untuned devices (skinny up to 4096 rows)."""
    table = {"GPU A": {"shapes": {"6144x4096": {"BLOCK_N": 2, "num_warps": 4}, "4096x4096": "cublas"}}}
    (tmp_path / "tuned.json").write_text(json.dumps(table))
    monkeypatch.setattr(gemv_settings, "TUNED_FILE", tmp_path / "tuned.json")
    gemv_settings.tuned_for.cache_clear()
    try:
        assert gemv_settings.setting_for("GPU A", 6144, 4096) == {"BLOCK_N": 2, "num_warps": 4}
        assert gemv_settings.setting_for("GPU A", 4096, 4096) is None
        assert gemv_settings.setting_for("GPU A", 4096, 4096, element_size=4) == {}
        assert gemv_settings.setting_for("GPU A", 6144, 4096, element_size=4) is None
        assert gemv_settings.setting_for("GPU B", 4096, 4096) == {}
        assert gemv_settings.setting_for(None, 6144, 4096) is None
    finally:
        gemv_settings.tuned_for.cache_clear()


def _recorded_settings() -> list[dict]:
    if not gemv_settings.TUNED_FILE.exists():
        return []
    entries = json.loads(gemv_settings.TUNED_FILE.read_text())
    found = {json.dumps(s, sort_keys=True) for device in entries.values() for s in device["shapes"].values()}
    return [json.loads(s) for s in sorted(found) if s != json.dumps(gemv_settings.CUBLAS)]


@pytest.mark.parametrize(
    "setting", _recorded_settings() or [pytest.param({}, marks=pytest.mark.skip("no table"))]
)
def test_every_recorded_setting_runs_and_matches_f_linear(device, setting):
    """Each setting the tuned table holds is one the kernel accepts and computes right with."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(1, 200, generator=gen), torch.randn(40, 200, generator=gen) / 200**0.5
    got = skinny_linear(to_device(x, device), w.to(device), None, setting)
    assert max_abs_err(got.cpu(), F.linear(x, w)) <= 1e-4
