"""Synthetic prompts with planted attention structure, and sparse-vs-dense accuracy metrics.

Queries and keys are built in disjoint coordinate groups so that each planted structure has a
known logit (softmax scale 1/sqrt(d) folded in):

* local window and periodic diagonals: rotary phases whose frequencies are the harmonics
  1..F of one period T. q_p = R(p) x and k_t = R(t) x give a logit that peaks (Dirichlet
  kernel) at p - t = 0 and repeats at every multiple of T: a local window plus slashes.
* sinks: the first `sinks` keys share a direction with every query.
* heavy hitters: a few scattered keys share another direction with every query.
* a needle: one key in the first half shares a direction only with a contiguous run of
  `seekers` queries in the middle, none of them among the last 64 (the blind spot of
  last-query estimation).
* diffuse noise in the few remaining coordinates. A rank-d construction cannot be perfectly
  sparse: the rotary part also leaks (RMS logit local / sqrt(2F) far from its peaks), so some
  attention mass is spread over all keys, as in real models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tgserve.kernels import reference
from tgserve.kernels.sparse.attention import estimate_index
from tgserve.kernels.sparse.config import HeadPattern
from tgserve.kernels.sparse.index import SparseIndex, index_to_mask


@dataclass(frozen=True)
class Planted:
    """Logit levels and shapes of the planted structure."""

    local: float = 10.0  # peak logit of the local window and of each periodic diagonal
    period_frac: float = 1 / 8  # diagonal period T as a fraction of the prompt
    sink: float = 13.0
    sinks: int = 4
    heavy: float = 9.0
    heavy_hitters: int = 8
    needle: float = 14.0
    seekers: int = 128
    noise: float = 0.5  # std of the logit from the noise coordinates


@dataclass
class Prompt:
    """A planted prompt and where its needle is."""

    query: torch.Tensor  # [n, H, d]
    key: torch.Tensor  # [n, Hkv, d]
    value: torch.Tensor  # [n, Hkv, d]
    scale: float
    needle: int  # key position of the needle
    seekers: range  # query positions that look for it


def rotary_pairs(head_dim: int) -> int:
    """Rotary pairs of a planted head: the first 2 x this many coordinates; then the sink's, the
    heavy hitters' and the needle's directions, one coordinate each; then noise."""
    return (head_dim - 3 - 5) // 2


def needle_coordinate(head_dim: int) -> int:
    return 2 * rotary_pairs(head_dim) + 2


def _rotary(pos: torch.Tensor, freqs: torch.Tensor, amp: float) -> torch.Tensor:
    """[len(pos), 2F]: (cos, sin) of each frequency at each position, times amp."""
    angle = pos[:, None].double() * freqs[None, :]
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=1) * amp


def planted_prompt(
    n: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int,
    plant: Planted = Planted(), dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> Prompt:  # fmt: skip
    """Build one planted prompt on `device` (heads of a KV group share keys; queries differ by noise)."""
    gen = torch.Generator().manual_seed(seed)  # host draws: positions of the planted tokens
    noise_gen = torch.Generator(device=device).manual_seed(seed)
    scale = head_dim**-0.5
    extra = 3  # sink, heavy-hitter and needle directions
    pairs = rotary_pairs(head_dim)
    noise_dims = head_dim - 2 * pairs - extra
    period = max(2 * pairs + 2, int(n * plant.period_frac))
    freqs = 2 * math.pi * torch.arange(1, pairs + 1, dtype=torch.float64, device=device) / period
    rot = _rotary(torch.arange(n, device=device), freqs, math.sqrt(plant.local / (scale * pairs)))

    def direction(level: float) -> float:
        return math.sqrt(level / scale)

    k_extra = torch.zeros(n, extra, dtype=torch.float64, device=device)
    k_extra[: plant.sinks, 0] = direction(plant.sink)
    heavy = torch.randperm(n - plant.sinks, generator=gen)[: plant.heavy_hitters] + plant.sinks
    k_extra[heavy.to(device), 1] = direction(plant.heavy)
    needle = int(torch.randint(plant.sinks, n // 2, (1,), generator=gen))
    k_extra[needle, 2] = direction(plant.needle)
    start = int(torch.randint(n // 2, max(n // 2 + 1, n - 64 - plant.seekers), (1,), generator=gen))
    seekers = range(start, min(start + plant.seekers, n - 64))
    q_extra = torch.zeros(n, extra, dtype=torch.float64, device=device)
    q_extra[:, 0] = direction(plant.sink)
    q_extra[:, 1] = direction(plant.heavy)
    q_extra[seekers.start : seekers.stop, 2] = direction(plant.needle)
    noise_amp = math.sqrt(plant.noise / (scale * math.sqrt(noise_dims)))

    def heads(count: int, planted: torch.Tensor) -> torch.Tensor:
        out = torch.empty(n, count, head_dim, dtype=dtype, device=device)
        out[..., : 2 * pairs] = rot[:, None].to(dtype)
        out[..., 2 * pairs : 2 * pairs + extra] = planted[:, None].to(dtype)
        noise = torch.randn(n, count, noise_dims, generator=noise_gen, device=device)
        out[..., 2 * pairs + extra :] = (noise * noise_amp).to(dtype)
        return out

    key = heads(num_kv_heads, k_extra)
    query = heads(num_heads, q_extra)
    value = torch.randn(n, num_kv_heads, head_dim, generator=noise_gen, device=device).to(dtype)
    return Prompt(query=query, key=key, value=value, scale=scale, needle=needle, seekers=seekers)


@dataclass
class Accuracy:
    """Sparse vs dense fp32: mean covered attention mass, relative L2 of outputs, needle recall."""

    mass: float
    rel_l2: float
    needle_recall: float
    density: float  # kept share of the causal entries


def evaluate(
    prompt: Prompt, index: SparseIndex, sparse_out: torch.Tensor | None = None, chunk: int = 1024
) -> Accuracy:
    """Compare the index (and the kernel's output, if given) with dense fp32 attention, by row chunks.

    Without sparse_out the sparse output is the masked reference. needle_recall is the share of the
    seekers' dense attention to the needle that the sparse mask keeps.
    """
    q, k, v = prompt.query, prompt.key, prompt.value
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    mass = err = ref = needle_kept = needle_all = visited = 0.0
    for r0 in range(0, n, chunk):
        rows = slice(r0, min(n, r0 + chunk))
        mask = index_to_mask(index, rows)  # [H, r, n]
        causal = reference.causal_mask(rows.stop - r0, rows.stop, device=q.device)
        kk = k[: rows.stop].float().repeat_interleave(group, 1).transpose(0, 1)  # [H, m, d]
        qq = q[rows].float().transpose(0, 1)
        probs = torch.softmax(((qq @ kk.transpose(1, 2)) * prompt.scale).masked_fill(~causal, -torch.inf), -1)
        kept = probs * mask[..., : rows.stop]
        visited += mask.double().sum().item()
        mass += kept.sum(-1).double().sum().item()
        vv = v[: rows.stop].float().repeat_interleave(group, 1).transpose(0, 1)
        dense = probs @ vv
        approx = (
            (kept / kept.sum(-1, keepdim=True)) @ vv
            if sparse_out is None
            else sparse_out[rows].float().transpose(0, 1)
        )
        err += (approx - dense).double().pow(2).sum().item()
        ref += dense.double().pow(2).sum().item()
        lo, hi = max(r0, prompt.seekers.start), min(rows.stop, prompt.seekers.stop)
        if hi > lo:
            p = probs[:, lo - r0 : hi - r0, prompt.needle]
            needle_all += p.double().sum().item()
            needle_kept += (p * mask[:, lo - r0 : hi - r0, prompt.needle]).double().sum().item()
    return Accuracy(
        mass=mass / (n * heads),
        rel_l2=math.sqrt(err / ref),
        needle_recall=needle_kept / max(needle_all, 1e-30),
        density=visited / (heads * n * (n + 1) / 2),
    )


def needle_recall(prompt: Prompt, index: SparseIndex) -> float:
    """Share of the seekers' dense attention to the needle that the sparse mask keeps (cheap)."""
    rows = slice(prompt.seekers.start, prompt.seekers.stop)
    q, k = prompt.query[rows].float().transpose(0, 1), prompt.key[: rows.stop].float()
    group = q.shape[0] // k.shape[1]
    kk = k.repeat_interleave(group, 1).transpose(0, 1)
    causal = reference.causal_mask(rows.stop - rows.start, rows.stop, device=q.device)
    probs = torch.softmax(((q @ kk.transpose(1, 2)) * prompt.scale).masked_fill(~causal, -torch.inf), -1)
    p = probs[..., prompt.needle]
    kept = p * index_to_mask(index, rows)[..., prompt.needle]
    return (kept.double().sum() / p.double().sum().clamp(min=1e-30)).item()


def accuracy_run(
    n: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int, pattern: HeadPattern, block: int = 64,
    plant: Planted = Planted(), dtype: torch.dtype = torch.float32, device: str = "cpu", use_triton: bool = False,
) -> Accuracy:  # fmt: skip
    """One planted prompt through the whole sparse path (estimate + attend), scored against dense fp32."""
    prompt = planted_prompt(n, num_heads, num_kv_heads, head_dim, seed, plant, dtype, device)
    patterns = [pattern] * num_heads
    index = estimate_index(prompt.query, prompt.key, prompt.scale, patterns, block, use_triton=use_triton)
    out = None
    if use_triton:
        from tgserve.kernels.sparse.kernel import sparse_attention_kernel

        out = sparse_attention_kernel(prompt.query, prompt.key, prompt.value, index, prompt.scale)
    return evaluate(prompt, index, out)


def needle_run(
    n: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int, pattern: HeadPattern, block: int = 64,
    plant: Planted = Planted(), device: str = "cpu", use_triton: bool = False, dtype: torch.dtype = torch.float32,
) -> float:  # fmt: skip
    """Needle recall of one planted prompt (estimation only: cheap enough for 100 seeds)."""
    prompt = planted_prompt(n, num_heads, num_kv_heads, head_dim, seed, plant, dtype, device)
    index = estimate_index(prompt.query, prompt.key, prompt.scale, [pattern] * num_heads, block,
                           use_triton=use_triton)  # fmt: skip
    return needle_recall(prompt, index)
