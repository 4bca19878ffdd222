"""The transformers fallback's rotary embedding on tgserve's fused kernel, where it matches exactly.

transformers writes `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` in each model's module:
`q * cos + rotate_half(q) * sin` in eager torch, five kernels for the queries and as many for the
keys at every layer, one more each where cos and sin are float32 and the result is cast back (as
OLMo-2's are). At batch-1 decode each is a launch of a few microseconds. A module's function is
replaced by one that takes `dispatch.rotary` (one launch for queries and keys) only when that
kernel's twin, the same torch operations over [tokens, heads, dim] views, gives its outputs bit for
bit on a probe, with cos and sin in the model's dtype and in float32. The replacement takes the
kernel only while tgserve's fallback model runs (`kernel_rotary`) and only for the shapes the
engine's flat batch gives (one sequence, unsqueeze_dim 1, the whole head rotated); everything else,
and every call outside the engine (a test's reference model in the same process), runs the
function transformers wrote.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import nn

from tgserve.kernels import dispatch, reference

logger = logging.getLogger(__name__)

FUNCTION_NAME = "apply_rotary_pos_emb"
Rotary = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_active = contextvars.ContextVar("tgserve_kernel_rotary", default=False)


@contextmanager
def kernel_rotary() -> Iterator[None]:
    """Within this block, replaced rotary functions take the fused kernel."""
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[1, heads, tokens, dim] as a [tokens, heads, dim] view."""
    return t[0].transpose(0, 1)


def _as_heads(rows: torch.Tensor, dtype: torch.dtype, cast_back: bool) -> torch.Tensor:
    return (rows.to(dtype) if cast_back else rows).transpose(0, 1)[None]


def fused_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cast_back: bool):
    """q [1, H, T, D], k [1, H_kv, T, D], cos / sin [1, T, D]: rotated by `dispatch.rotary`, in the
    dtype q and cos promote to; with `cast_back`, returned in q's and k's dtypes (as OLMo-2's
    function returns float32 cos and sin's products)."""
    q_rows, k_rows = dispatch.rotary(_as_rows(q), _as_rows(k), cos[0], sin[0])
    return _as_heads(q_rows, q.dtype, cast_back), _as_heads(k_rows, k.dtype, cast_back)


def _twin(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cast_back: bool):
    """What `fused_rotary` computes, in torch: the kernel's twin on the same views."""
    q_rows, k_rows = reference.rotary(_as_rows(q), _as_rows(k), cos[0], sin[0])
    return _as_heads(q_rows, q.dtype, cast_back), _as_heads(k_rows, k.dtype, cast_back)


def _engine_shapes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """One sequence of [1, heads, tokens, dim] with cos / sin [1, tokens, dim] over the whole head."""
    return (
        q.dim() == 4
        and k.dim() == 4
        and q.shape[0] == 1
        and k.shape[0] == 1
        and k.shape[2:] == q.shape[2:]
        and cos.shape == sin.shape == (1, q.shape[2], q.shape[3])
        and q.shape[3] % 2 == 0
    )


def _plain_call(args: tuple, kwargs: dict) -> bool:
    """`(q, k, cos, sin)` given by position, all tensors, unsqueezed at dim 1 (by default or by name)."""
    return (
        len(args) in (4, 5)
        and args[4:] in ((), (1,))
        and kwargs in ({}, {"unsqueeze_dim": 1})
        and all(isinstance(t, torch.Tensor) for t in args[:4])
    )


# (query dtype, cos dtype) -> whether the function casts its outputs back to the query's dtype
Approved = dict[tuple[torch.dtype, torch.dtype], bool]


def _replacement(original: Rotary) -> Rotary:
    """`original`, taking the kernel for the engine's calls in the dtypes its probes approved
    (`tgserve_approved`, grown as models of other dtypes load)."""
    approved: Approved = {}

    def apply_rotary_pos_emb(*args, **kwargs):
        # Any other call form (Qwen4-Exp rotates queries alone: `q, cos=..., sin=...`) is the original's.
        if _active.get() and _plain_call(args, kwargs):
            q, k, cos, sin = args[:4]
            cast_back = approved.get((q.dtype, cos.dtype))
            if cast_back is not None and _engine_shapes(q, k, cos, sin):
                return fused_rotary(q, k, cos, sin, cast_back)
        return original(*args, **kwargs)

    apply_rotary_pos_emb.tgserve_original = original  # type: ignore[attr-defined]
    apply_rotary_pos_emb.tgserve_approved = approved  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _probe(dtype: torch.dtype, cos_dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Queries and keys laid out as a projection's rows viewed by head ([1, T, H, D] transposed),
    and the cos / sin of real rotary angles at varied positions."""
    gen = torch.Generator().manual_seed(0)
    tokens, dim = 7, 16
    q = torch.randn(1, tokens, 4, dim, generator=gen).to(dtype).transpose(1, 2)
    k = (torch.randn(1, tokens, 2, dim, generator=gen) * 30).to(dtype).transpose(1, 2)
    positions = torch.tensor([0, 1, 5, 17, 300, 4095, 70000], dtype=torch.float32)
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.cat([positions[:, None] * inv_freq[None]] * 2, dim=-1)[None]
    return tuple(t.to(device) for t in (q, k, angles.cos().to(cos_dtype), angles.sin().to(cos_dtype)))


def _same(want: object, got: tuple[torch.Tensor, torch.Tensor]) -> bool:
    if not isinstance(want, tuple) or len(want) != 2:
        return False
    return all(
        isinstance(w, torch.Tensor) and w.dtype == g.dtype and w.shape == g.shape and torch.equal(w, g)
        for w, g in zip(want, got, strict=True)
    )


def kernel_forms(function: Rotary, dtype: torch.dtype, device: torch.device) -> Approved:
    """For queries in `dtype` and cos / sin in it or in float32: the probes the kernel's twin gives
    this function's outputs bit for bit on, and whether with the cast back."""
    forms: Approved = {}
    for cos_dtype in dict.fromkeys((dtype, torch.float32)):
        q, k, cos, sin = _probe(dtype, cos_dtype, device)
        try:
            with torch.no_grad():
                want = function(q, k, cos, sin)
        except Exception:  # a function of another signature or layout
            return {}
        for cast_back in (True, False):
            if _same(want, _twin(q, k, cos, sin, cast_back)):
                forms[(dtype, cos_dtype)] = cast_back
                break
    return forms


def _model_modules(model: nn.Module) -> list[ModuleType]:
    names = dict.fromkeys(type(m).__module__ for m in model.modules())
    return [sys.modules[name] for name in names if name in sys.modules]


def swap_in_kernel_rotary(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace the rotary function of each of the model's modeling modules that the kernel matches
    exactly in this dtype (once per process: a replaced function stays, idle outside
    `kernel_rotary`); how many of the model's modules take the kernel."""
    device = next(model.parameters()).device
    taken = 0
    for module in _model_modules(model):
        function = getattr(module, FUNCTION_NAME, None)
        if not callable(function):
            continue
        original = getattr(function, "tgserve_original", function)
        forms = kernel_forms(original, dtype, device)
        if not forms:
            continue
        if not hasattr(function, "tgserve_approved"):
            function = _replacement(original)
            setattr(module, FUNCTION_NAME, function)
        function.tgserve_approved.update(forms)
        taken += 1
    if taken:
        logger.info(
            "transformers fallback: rotary embedding of %d modeling module(s) on tgserve's kernel", taken
        )
    return taken
