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


# ---------------------------------------------------------------------------------------------
# Structured prompts: real rotary frequencies, several needles of several reaches.


@dataclass(frozen=True)
class Structure:
    """Planted structure of a structured prompt (levels are logits, the softmax scale folded in).

    Unlike `Planted`, whose harmonics of one period give exactly periodic diagonals, the rotary
    part here uses a model's geometric RoPE frequencies base^(-i / pairs): queries and keys share a
    direction per KV head, so the logit depends on the offset p - t alone (every structure in it is
    a diagonal), peaking at 0 and echoing at the offsets where the heavier pairs come back in phase.
    `spread` is the log-std of the pair energies: large values put the energy on a few pairs, whose
    echoes form strong diagonals far from the main one; small values give a smooth window.
    """

    rope_base: float = 500000.0
    local: float = 10.0  # rotary logit at offset 0
    spread: float = 2.0
    sinks: int = 16
    sink: float = 13.0
    heavy_hitters: int = 64
    heavy: float = 9.0
    needle: float = 14.0
    seekers: tuple[int, ...] = (16, 64, 512)  # queries that look for a needle, one needle per (depth, count)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)  # needle keys at these fractions of the prompt
    noise: float = 0.5  # std of the logit from the noise coordinates
    period: float = 0.0  # > 0: harmonics of one period (this fraction of n) instead of RoPE frequencies


@dataclass(frozen=True)
class Needle:
    """One key that only `seekers` (a run of queries after it, none among the last 64) look for."""

    key: int
    seekers: range
    depth: float


@dataclass
class StructuredPrompt:
    query: torch.Tensor  # [n, H, d]
    key: torch.Tensor  # [n, Hkv, d]
    value: torch.Tensor  # [n, Hkv, d]
    scale: float
    needles: list[Needle]


def _pair_weights(count: int, pairs: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    """[count, pairs] log-normal energies (log-std `spread`), each row normalised to sum 1."""
    w = torch.exp(spread * torch.randn(count, pairs, generator=gen, dtype=torch.float64))
    return w / w.sum(1, keepdim=True)


def _place_needles(n: int, plant: Structure, gen: torch.Generator) -> list[Needle]:
    needles = []
    for depth in plant.depths:
        for j, count in enumerate(plant.seekers):  # one key each, a little apart
            key = min(n - 66, plant.sinks + int(depth * (n - plant.sinks)) + 97 * j)
            last_start = max(key + 1, n - 64 - count)
            start = int(torch.randint(key + 1, last_start + 1, (1,), generator=gen))
            needles.append(Needle(key=key, seekers=range(start, min(start + count, n - 64)), depth=depth))
    return needles


def structured_prompt(
    n: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int,
    plant: Structure = Structure(), dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> StructuredPrompt:  # fmt: skip
    """One structured prompt: rotary diagonals, sinks, heavy hitters and needles, built on `device`.

    Coordinates: rotary pairs first, then one each for sinks, heavy hitters and every needle, then
    noise. Query heads of a KV group weigh the shared rotary pairs, the sinks and the heavy hitters
    differently (their own draws), as the heads of a real group do.
    """
    gen = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator(device=device).manual_seed(seed)
    scale = head_dim**-0.5
    needles = _place_needles(n, plant, gen)
    extra = 2 + len(needles)
    pairs = (head_dim - extra - 4) // 2
    noise_dims = head_dim - 2 * pairs - extra
    if pairs < 8:
        raise ValueError(f"head_dim {head_dim} leaves {pairs} rotary pairs for {len(needles)} needles")
    group = num_heads // num_kv_heads
    if plant.period > 0:  # sharp diagonals at every multiple of the period, off the block grid
        freqs = 2 * math.pi * torch.arange(1, pairs + 1, dtype=torch.float64) / (plant.period * n)
    else:
        freqs = plant.rope_base ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
    key_energy = _pair_weights(num_kv_heads, pairs, plant.spread, gen)  # [Hkv, P]
    query_energy = _pair_weights(num_heads, pairs, plant.spread, gen)  # [H, P]
    logit = key_energy.repeat_interleave(group, 0) * query_energy
    logit = plant.local * logit / logit.sum(1, keepdim=True)  # [H, P]: pair i's logit at offset 0
    phase = torch.rand(num_kv_heads, pairs, generator=gen, dtype=torch.float64) * 2 * math.pi
    key_amp = torch.sqrt(key_energy / scale * plant.local)  # [Hkv, P]
    query_amp = logit / (scale * key_amp.repeat_interleave(group, 0))  # [H, P]

    def rotary(amp: torch.Tensor, heads_phase: torch.Tensor) -> torch.Tensor:
        angle = torch.arange(n, dtype=torch.float64, device=device)[:, None, None] * freqs.to(device)
        angle = angle + heads_phase.to(device)  # [n, heads, P]
        amp = amp.to(device)
        return torch.cat([torch.cos(angle) * amp, torch.sin(angle) * amp], dim=-1)

    def direction(level: torch.Tensor | float) -> torch.Tensor | float:
        return (level / scale) ** 0.5 if isinstance(level, float) else torch.sqrt(level / scale)

    key = torch.zeros(n, num_kv_heads, head_dim, dtype=dtype, device=device)
    query = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
    key[..., : 2 * pairs] = rotary(key_amp, phase).to(dtype)
    query[..., : 2 * pairs] = rotary(query_amp, phase.repeat_interleave(group, 0)).to(dtype)
    sink_c, heavy_c, first_needle = 2 * pairs, 2 * pairs + 1, 2 * pairs + 2
    key[: plant.sinks, :, sink_c] = direction(plant.sink)
    query[..., sink_c] = direction(plant.sink * (0.7 + 0.3 * torch.rand(num_heads, generator=gen))).to(dtype)
    heavy = torch.randperm(n - plant.sinks, generator=gen)[: plant.heavy_hitters] + plant.sinks
    key[heavy.to(device), :, heavy_c] = direction(plant.heavy)
    query[..., heavy_c] = direction(plant.heavy * (0.5 + 0.5 * torch.rand(num_heads, generator=gen))).to(
        dtype
    )
    for i, needle in enumerate(needles):
        key[needle.key, :, first_needle + i] = direction(plant.needle)
        query[needle.seekers.start : needle.seekers.stop, :, first_needle + i] = direction(plant.needle)
    noise_amp = math.sqrt(plant.noise / (scale * math.sqrt(noise_dims)))
    for x in (key, query):
        noise = torch.randn(*x.shape[:2], noise_dims, generator=noise_gen, device=device)
        x[..., head_dim - noise_dims :] = (noise * noise_amp).to(dtype)
    value = torch.randn(n, num_kv_heads, head_dim, generator=noise_gen, device=device).to(dtype)
    return StructuredPrompt(query=query, key=key, value=value, scale=scale, needles=needles)


# Families of structure, so that no estimate is judged on one input family.
STRUCTURES = {
    "rope": Structure(),
    "rope-smooth": Structure(spread=0.5),  # energy over many pairs: a window, weaker far diagonals
    "rope-10k": Structure(rope_base=10000.0),  # faster frequencies: echoes nearer the main diagonal
    "diffuse": Structure(local=6.0, noise=1.5),  # weaker peaks, more mass over all keys
    "sharp": Structure(local=14.0, sink=16.0, heavy=12.0, needle=17.0, noise=0.3),  # sparse at 128K too
    "far-slashes": Structure(local=14.0, sink=16.0, heavy=12.0, needle=17.0, spread=0.5, period=0.0123),
}
