"""The CUDA backend refuses a Triton too old for its kernels with an error that says what to install."""

import pytest

from tgserve.kernels.triton_support import check_triton, installed_triton


@pytest.mark.parametrize("version", ["3.4.0", "3.6.0", "3.10.1", "4.0.0", "3.5.0+git1a2b3c"])
def test_recent_triton_passes(version):
    check_triton(version)


@pytest.mark.parametrize("version", ["3.1.0", "3.3.1", "2.3.1"])
def test_old_triton_names_found_and_needed(version):
    with pytest.raises(RuntimeError) as err:
        check_triton(version)
    message = str(err.value)
    assert version in message and ">= 3.4" in message and "tgserve[cuda]" in message


def test_missing_triton_says_what_to_install():
    with pytest.raises(RuntimeError, match=r"none is installed.*tgserve\[cuda\]"):
        check_triton(None)


def test_this_environment_meets_its_own_floor():
    version = installed_triton()
    assert version is not None, "the dev extra installs Triton"
    check_triton(version)


def test_choosing_the_cuda_backend_checks_triton(monkeypatch):
    import torch

    from tgserve.kernels import triton_support
    from tgserve.server.attention.registry import attention_backend

    monkeypatch.setattr(triton_support, "installed_triton", lambda: "3.1.0")
    with pytest.raises(RuntimeError, match="this environment has 3.1.0"):
        attention_backend(torch.device("cuda"))
