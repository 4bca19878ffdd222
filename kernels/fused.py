"""Triton kernels for a decoder layer's elementwise glue: RMSNorm (with the residual add), rotary
(optionally after each head's RMSNorm, Qwen3's query and key norms), SiLU- and tanh-GELU-and-mul.

Twins: `reference.rms_norm`, `fused_add_rms_norm`, `rotary`, `silu_and_mul`, `gelu_tanh_and_mul`.
In eager torch each of these is a chain of small kernels (the fp32 RMSNorm alone is six); at
batch-1 decode their launches cost a third as much as the layer's GEMMs, so each becomes one
launch here.

Rounding follows the twins' op boundaries: wherever torch materialises an intermediate tensor in the
input dtype, the kernel rounds to that dtype too (every op computed in fp32, then rounded: what
torch's CUDA kernels do per op). Each elementwise op is therefore correctly rounded like torch's;
what may still differ is the reduction order of the RMSNorm mean and the last bits of exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgserve.kernels.triton_common import pdl, tanh, wait_for_inputs

# ---- RMSNorm, optionally preceded by the residual add ----


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    weight_ptr,
    out_ptr,
    res_out_ptr,
    rows_inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # Rows are (outer, inner) pairs so that per-head views of a fused QKV output ([T, H, D] with a
    # token stride wider than H * D) need no copy.
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // rows_inner, row % rows_inner
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a weight: readable before the wait
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        # The norm reads the sum as stored in the residual stream's dtype, as after torch's add.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)).to(x.dtype)
    # fp32 holds the product of two 16-bit floats exactly: one rounding, as torch's promoted multiply.
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x as [outer, inner, n] rows with a unit-stride last dim: (tensor, inner count, strides)."""
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x2 = x.view(1, -1) if x.dim() == 1 else x
    return x2, 1, x2.stride(0), 0


def _norm_warps(block_n: int) -> int:
    return min(max(block_n // 512, 1), 8)


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
) -> None:
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0:
        return
    assert weight.shape == (n,) and weight.is_contiguous()
    xr, inner, sxo, sxi = _as_rows(x)
    rr, inner_r, sro, sri = _as_rows(residual) if residual is not None else (xr, inner, sxo, sxi)
    if inner_r != inner:  # the two decompose differently: fall back to flat rows for both
        xr, inner, sxo, sxi = _as_rows(x.reshape(-1, n))
        rr, _, sro, sri = _as_rows(residual.reshape(-1, n))
    block_n = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        xr,
        rr,
        weight,
        out,
        res_out if res_out is not None else out,
        inner,
        sxo,
        sxi,
        sro,
        sri,
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=_norm_warps(block_n),
        **pdl(x),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of x [..., n] in fp32; `weight * normed.to(x.dtype)`, contiguous."""
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass, contiguous.

    in_place: the outputs are written over x and residual where their dtypes and contiguous layout
    allow (each program reads its whole row before it writes), else they are new as without it.
    """
    assert x.shape == residual.shape
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, res_dtype)
    if in_place and _can_overwrite(x, residual, out_dtype):
        out, res_out = x, residual
    else:
        res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, res_out)
    return out, res_out


def _can_overwrite(x: torch.Tensor, residual: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the norm's outputs fit over its inputs: one dtype throughout, both contiguous (the
    kernel writes rows at the contiguous layout's offsets), and not one tensor twice."""
    same_dtype = x.dtype == residual.dtype == out_dtype
    contiguous = x.is_contiguous() and residual.is_contiguous()
    return same_dtype and contiguous and x.data_ptr() != residual.data_ptr()


# ---- rotary (rotate-half / GPT-NeoX layout) ----


@triton.jit
def _round_mul(a, b, ty: tl.constexpr):
    return (a.to(tl.float32) * b.to(tl.float32)).to(ty)


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_h,
    first_head,
    num_heads,
    half,
    cos1,
    cos2,
    sin1,
    sin2,
    norm_ptr,
    eps,
    NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = first_head + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half)
    src = src_ptr + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    ty: tl.constexpr = dst_ptr.dtype.element_ty
    if NORM:  # each head's RMSNorm first, rounded as `_rms_norm_kernel` rounds
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(norm_ptr + dims, mask=dims < half, other=0.0)[None, :]
        w2 = tl.load(norm_ptr + half + dims, mask=dims < half, other=0.0)[None, :]
        x1 = _round_mul((f1 * inv).to(ty), w1, ty)
        x2 = _round_mul((f2 * inv).to(ty), w2, ty)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the output dtype.
    y1 = _round_mul(x1, cos1[None, :], ty).to(tl.float32) + _round_mul(-x2, sin1[None, :], ty).to(tl.float32)
    y2 = _round_mul(x2, cos2[None, :], ty).to(tl.float32) + _round_mul(x1, sin2[None, :], ty).to(tl.float32)
    dst = dst_ptr + heads[:, None] * (2 * half) + dims[None, :]
    tl.store(dst, y1.to(ty), mask=mask)
    tl.store(dst + half, y2.to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    num_q_heads,
    num_k_heads,
    q_blocks,
    half,
    NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # One launch for queries and keys: programs past the query head blocks take the key heads.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    cos1 = tl.load(cos_ptr + token * stride_ct + dims, mask=dmask, other=0.0)
    cos2 = tl.load(cos_ptr + token * stride_ct + half + dims, mask=dmask, other=0.0)
    sin1 = tl.load(sin_ptr + token * stride_st + dims, mask=dmask, other=0.0)
    sin2 = tl.load(sin_ptr + token * stride_st + half + dims, mask=dmask, other=0.0)
    if block < q_blocks:
        _rotate_heads(q_ptr + token * stride_qt, q_out_ptr + token * num_q_heads * 2 * half, stride_qh,
                      block * BLOCK_H, num_q_heads, half, cos1, cos2, sin1, sin2, q_norm_ptr, eps, NORM, BLOCK_H,
                      BLOCK_HALF)  # fmt: skip
    else:
        _rotate_heads(k_ptr + token * stride_kt, k_out_ptr + token * num_k_heads * 2 * half, stride_kh,
                      (block - q_blocks) * BLOCK_H, num_k_heads, half, cos1, cos2, sin1, sin2, k_norm_ptr, eps,
                      NORM, BLOCK_H, BLOCK_HALF)  # fmt: skip


def _unit_stride_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _cos_sin_rows(t: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    """cos or sin ([T, 1, D] or [T, D]) as [T, D] rows with a unit-stride last dim."""
    assert t.shape[0] == num_tokens and t.shape[-1] == head_dim and t.numel() == num_tokens * head_dim
    return _unit_stride_last(t.reshape(num_tokens, head_dim))


def _rotary_block_h(num_heads: int, block_half: int) -> int:
    """Heads per program: about 512 element pairs each, so decode still spreads over several SMs."""
    return max(1, min(triton.next_power_of_2(num_heads), 512 // block_half))


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of query [T, Hq, D] and key [T, Hk, D] (strided views allowed), into new
    contiguous outputs or into `out`, contiguous tensors of their shapes (rows of a larger one).
    qk_norm: (query weight [D], key weight [D], eps), each head's RMSNorm (`rms_norm`) applied
    before the rotation in the same launch (Qwen3's per-head norms: two launches fewer a layer)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert key.shape == (num_tokens, num_k_heads, head_dim) and key.dtype == query.dtype
    assert head_dim % 2 == 0, "rotate-half needs an even head_dim"
    out_dtype = torch.promote_types(query.dtype, cos.dtype)
    if out is None:
        q_out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
        k_out = torch.empty(key.shape, dtype=out_dtype, device=key.device)
    else:
        q_out, k_out = out
        assert q_out.shape == query.shape and k_out.shape == key.shape
        assert q_out.dtype == k_out.dtype == out_dtype and q_out.is_contiguous() and k_out.is_contiguous()
    if num_tokens == 0:
        return q_out, k_out
    query, key = _unit_stride_last(query), _unit_stride_last(key)
    cos, sin = _cos_sin_rows(cos, num_tokens, head_dim), _cos_sin_rows(sin, num_tokens, head_dim)
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = _rotary_block_h(max(num_q_heads, num_k_heads), block_half)
    q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, q_blocks + triton.cdiv(num_k_heads, block_h))
    q_norm, k_norm, eps = qk_norm or (query, key, 0.0)  # unread without the norms
    if qk_norm is not None:
        assert (
            q_norm.shape == k_norm.shape == (head_dim,)
            and q_norm.dtype == k_norm.dtype == query.dtype == out_dtype
        )
    # No FMA contraction: fp32 then rounds the two products apart, as torch's separate kernels do.
    _rotary_kernel[grid](query, key, cos, sin, q_out, k_out, q_norm, k_norm, eps, query.stride(0), query.stride(1),
                         key.stride(0), key.stride(1), cos.stride(0), sin.stride(0), num_q_heads, num_k_heads,
                         q_blocks, head_dim // 2, NORM=qk_norm is not None, BLOCK_H=block_h, BLOCK_HALF=block_half,
                         enable_fp_fusion=False, **pdl(query))  # fmt: skip
    return q_out, k_out


# ---- SiLU(gate) * up ----


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, inter, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):  # fmt: skip
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + inter + cols, mask=mask, other=0.0)
    ty: tl.constexpr = out_ptr.dtype.element_ty
    # torch's formulas, rounded to the dtype before the multiply as its own kernels' outputs are.
    if GELU_TANH:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
        act = (0.5 * gate * (1.0 + tanh(inner))).to(ty)
    else:  # silu
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(ty)
    tl.store(out_ptr + token * inter + cols, _round_mul(act, up, ty), mask=mask)


ACT_BLOCK = 1024


def _act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    width = gate_up.shape[-1]
    assert width % 2 == 0
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // inter if inter else 0
    if rows == 0:
        return out
    x = _unit_stride_last(gate_up).reshape(-1, width)
    block = min(ACT_BLOCK, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x,
        out,
        x.stride(0),
        inter,
        GELU_TANH=gelu_tanh,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
        **pdl(x),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :I]) * gate_up[..., I:] for gate_up [..., 2I]; a new contiguous [..., I]."""
    return _act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate_up[..., :I]) * gate_up[..., I:] for gate_up [..., 2I]; a new contiguous [..., I]."""
    return _act_and_mul(gate_up, gelu_tanh=True)
