"""Public attention entry points: Triton (or the fastest library kernel) on CUDA, torch elsewhere.

The backends call only these. Triton modules are imported lazily, on the CUDA path only, so that
importing this module never imports Triton (a CPU process, or a test run that must set
TRITON_INTERPRET before the first @triton.jit, stays unaffected).

    write_kv          this step's keys/values into the paged cache (slot -1 skipped)
    paged_decode      one query per sequence over the paged cache (stores the step's keys itself),
                      or, with a selection, over the blocks chosen per KV head
    select_decode_blocks
                      selective decode: the blocks each decode query attends (decode_selection.py)
    fill_from_host    heads of host-tier blocks copied into device blocks (the hot-block cache)
    update_key_summaries
                      a step's keys folded into their blocks' key summaries
    paged_prefill     varlen queries over the paged cache: chunked prefill, prefix hits, mixed steps
    fresh_prefill     prompts with no cached prefix: dense (library kernel) or sparse when long
    rms_norm, fused_add_rms_norm, rotary, silu_and_mul
                      a decoder layer's elementwise glue, one fused kernel each on CUDA
    fused_moe         a mixture-of-experts layer's experts: two grouped GEMMs on CUDA (moe.py)
    linear            a projection: cuBLAS, or for one row and a small weight the skinny kernel;
                      fp8 weights (--quantize fp8) through fp8.fp8_linear
    argmax            greedy decoding's pick per row (two short launches instead of torch's one
                      block per row)

Which of the three attention paths a step takes is the attention backend's choice, made once per
step (`server/attention/cuda.py`); each entry point here runs the one it is asked for.
"""

from __future__ import annotations

import torch

from tgserve.kernels import moe_routing, reference
from tgserve.kernels.decode_selection import DecodeSelection, choose_blocks, top_blocks
from tgserve.kernels.moe_routing import ClampedSwiGLU
from tgserve.kernels.sparse.config import SparseConfig


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors; everything else takes the torch reference."""
    return t.is_cuda


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots of kv_cache (quantized,
    with their scales in kv_scale, when the cache is fp8; with `tail`, an 8-bit cache's tail slots
    and block -> slot map, rows of blocks with a slot stored there too, unquantized)."""
    if use_triton(key):
        from tgserve.kernels.kv_write import write_kv as triton_write_kv

        triton_write_kv(key, value, kv_cache, slot_mapping, kv_scale, tail)
    else:
        reference.write_kv(key, value, kv_cache, slot_mapping, kv_scale)
        if tail is not None:
            reference.write_tail(key, value, slot_mapping, tail)


def update_key_summaries(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1: not stored
    key_summary: torch.Tensor,  # [2, num_blocks, num_kv_heads, head_dim]
    block_size: int,
) -> None:
    """Fold a step's keys into their blocks' key minimum and maximum (`decode_selection`)."""
    if use_triton(key):
        from tgserve.kernels.summary_fold import fold_key_summaries

        fold_key_summaries(key, slot_mapping, key_summary, block_size)
    else:
        reference.update_key_summaries(key, slot_mapping, key_summary, block_size)


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence, its last position
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    step_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    selection: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_summary: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    sinks: torch.Tensor | None = None,
    hot: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context: the split-context decode kernel on CUDA.

    max_seq_len: a host-side bound on seq_lens that sizes the kernel's context splits. step_kv:
    this step's (key, value, slot_mapping), stored into the cache first; the CUDA kernel stores
    them itself (one launch a layer fewer at batch-1 decode). kv_scale: an 8-bit cache's scales
    [2, num_blocks, num_kv_heads, block_size] (float32), None for a cache in the model's dtype.
    selection: (chosen, lengths): `select_decode_blocks` and the selection's `lengths` (full-attention layers).
    key_summary: the layer's key summaries, which the step's keys are folded into. host: (host
    blocks' cache, their scales or None, first host id): table entries from that id on name host
    blocks, read where they lie (the long-context tier). sinks: float32 [num_heads], learned
    per-head sink logits (gpt-oss): a key of zero value in every row's softmax. hot: with host and
    selection, int32 [num_kv_heads, host blocks]: the device block holding each KV head of a host
    block, or -1 (the hot-block cache, `server/kv_cache/hot_blocks.py`), read there instead.
    tail: an 8-bit cache's (tail slots, block -> slot map) (`server/kv_cache/tail_blocks.py`): the
    step's rows stored there too where their block has a slot, each current block read from it.
    """
    assert selection is None or sliding_window is None, "selection is for full-attention layers"
    if use_triton(query):
        from tgserve.kernels.paged_decode import paged_decode as triton_paged_decode

        return triton_paged_decode(query, kv_cache, block_tables, seq_lens, scale, sliding_window, softcap, out,
                                   max_seq_len=max_seq_len, step_kv=step_kv, kv_scale=kv_scale, selection=selection,
                                   key_summary=key_summary, host=host, sinks=sinks, hot=hot, tail=tail)  # fmt: skip
    if step_kv is not None:
        write_kv(*step_kv[:2], kv_cache, step_kv[2], kv_scale, tail)
        if key_summary is not None:
            update_key_summaries(step_kv[0], step_kv[2], key_summary, kv_cache.shape[2])
    if selection is not None:
        result = reference.selected_decode(query, kv_cache, block_tables, seq_lens, *selection, scale, softcap,
                                           kv_scale, host, sinks, hot, tail)  # fmt: skip
        return result if out is None else out.copy_(result)
    one_query_each = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    result = reference.paged_attention(query, kv_cache, block_tables, one_query_each, seq_lens, scale,
                                       sliding_window, softcap, kv_scale=kv_scale, host=host, sinks=sinks,
                                       tail=tail)  # fmt: skip
    return result if out is None else out.copy_(result)


def fill_from_host(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    host_cache: torch.Tensor,
    host_scale: torch.Tensor | None,
    sources: torch.Tensor,
    targets: torch.Tensor,
) -> None:
    """Copy heads of host blocks into device blocks (`kernels/host_fill.py`): the hot-block cache's
    fill, one launch a layer on CUDA, read from pinned host memory in place."""
    if use_triton(kv_cache):
        from tgserve.kernels.host_fill import fill_from_host as triton_fill_from_host

        triton_fill_from_host(kv_cache, kv_scale, host_cache, host_scale, sources, targets)
    else:
        reference.fill_from_host(kv_cache, kv_scale, host_cache, host_scale, sources, targets)


def select_decode_blocks(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_summary: torch.Tensor,  # [2, num_blocks, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, width]
    seq_lens: torch.Tensor,  # int32 [num_seqs], this step's token included
    selection: DecodeSelection,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int, tuple | None] | None = None,
) -> torch.Tensor:
    """int64 [num_seqs, num_kv_heads, k - 1]: per KV head the block-table columns each decode query
    attends besides its current block (`kernels/decode_selection.py`): the blocks with the best
    bounds, scored again by their true largest logit, and the best of those. With the step's
    `DecodeSelection.lengths`, paged_decode's `selection`. Device tensors only, no host sync: a
    CUDA graph captures it. `host`: (host blocks' cache, scales or None, key summaries, first host
    id, device copies of their keys or None: `LayerKeyCopy`'s (keys, scales, slot_of)): table
    entries from that id on are host blocks, read where they lie, their candidates' keys from a
    copy where they have one."""
    block_size, width = kv_cache.shape[2], block_tables.shape[1]
    args = (query, key_summary, block_tables, seq_lens, block_size, selection.sink_blocks(block_size),
            selection.recent_blocks(block_size))  # fmt: skip
    if use_triton(query):
        from tgserve.kernels.block_scores import block_scores, candidate_scores
    else:
        block_scores, candidate_scores = reference.block_scores, reference.candidate_scores
    host_blocks, host_summary, key_copy = None, None, None
    if host is not None:
        host_blocks, host_summary, key_copy = (host[0], host[1], host[3]), (host[2], host[3]), host[4]
    bound = block_scores(*args, host_summary=host_summary)
    candidates = top_blocks(bound, selection.candidate_blocks(block_size, width))
    exact = candidate_scores(query, kv_cache, block_tables, candidates, bound, kv_scale, host=host_blocks,
                             key_copy=key_copy)  # fmt: skip
    return candidates.gather(2, choose_blocks(exact, selection.chosen_blocks(block_size, width)))


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    host: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
    sinks: torch.Tensor | None = None,
    tail: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each sequence's queries (its last positions) over its paged context, this step's keys and
    values already stored: chunked prefill, prefix hits, prompts beside decode rows (`host`,
    `sinks`, `tail`: as `paged_decode` takes them)."""
    if use_triton(query):
        from tgserve.kernels.paged_prefill import paged_prefill as triton_paged_prefill

        return triton_paged_prefill(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                                    softcap, out, kv_scale=kv_scale, host=host, sinks=sinks, tail=tail)  # fmt: skip
    result = reference.paged_attention(query, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                       sliding_window, softcap, kv_scale=kv_scale, host=host, sinks=sinks,
                                       tail=tail)  # fmt: skip
    return result if out is None else out.copy_(result)


def _flash_attn_varlen():
    """flash-attn's varlen kernel if the package is installed (the fastest dense prefill)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


SDPA_MIN_TOKENS = 2048  # prompts this long take SDPA one by one (launch cost negligible)

# A sequence at least this long takes cuDNN's attention first, a shorter one flash's. On an H200
# cuDNN is the faster kernel on long prompts (a layer of Llama-3-8B's heads: 3.4 against 6.4 ms at
# 16K tokens, 13.7 against 25.8 at 32K), but it builds an execution plan for each sequence length
# it has not seen (63-76 ms, then cached), and a prompt of a new length waits for that: below
# ~13K tokens the build costs more than cuDNN saves over 32 layers. Flash builds nothing and is
# as fast or faster up to 2K tokens (docs/benchmarks/2026-11-30-residual-epilogue-and-sdpa-plans-h200.md).
CUDNN_MIN_TOKENS = 12288


def sdpa_backends(num_tokens: int) -> list:
    """SDPA backends in the order to try for one causal sequence of num_tokens (CUDNN_MIN_TOKENS)."""
    from torch.nn.attention import SDPBackend

    fast = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    if num_tokens < CUDNN_MIN_TOKENS:
        fast.reverse()
    return [*fast, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One causal sequence [n, heads, d] through SDPA, cuDNN or flash first by length (GQA native).

    PyTorch's default priority does not put cuDNN first, which long prompts want: sdpa_backends.
    """
    from torch.nn.attention import sdpa_kernel

    order = sdpa_backends(query.shape[0])
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
    try:
        context = sdpa_kernel(order, set_priority=True)
    except TypeError:  # PyTorch < 2.6: no priorities, its own order
        context = sdpa_kernel(order)
    with context:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=True)  # fmt: skip
    return out[0].transpose(0, 1).contiguous()


def _rows_of(starts: list[int], ends: list[int], device: torch.device) -> torch.Tensor:
    """Device row indices of the given sequences, copied without blocking the host."""
    rows = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends)])
    return rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows


def dense_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,  # int32 [num_seqs + 1]
    max_seqlen: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seqlens_cpu: list[int] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of fresh prompts packed back to back, with the fastest kernel at hand.

    CUDA order: with learned sinks, Triton varlen (the library kernels take none); else flash-attn
    varlen (GQA, window, softcap) if installed; else, without window or softcap, SDPA (flash or
    cuDNN first by length: sdpa_backends) for a single sequence, and for each sequence of at least
    SDPA_MIN_TOKENS when the host offsets are given, the shorter ones packed into one Triton varlen
    launch; else Triton varlen for the whole pack.
    """
    if not use_triton(query):
        return reference.varlen_attention(
            query, key, value, cu_seqlens, scale, sliding_window, softcap, sinks=sinks
        )
    if sinks is not None:
        from tgserve.kernels.paged_prefill import varlen_prefill

        return varlen_prefill(query, key, value, cu_seqlens, scale, sliding_window, softcap, sinks=sinks)
    flash = _flash_attn_varlen()
    if flash is not None and query.dtype in (torch.float16, torch.bfloat16):
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        return flash(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale,
                     causal=True, window_size=window, softcap=softcap or 0.0)  # fmt: skip
    from tgserve.kernels.paged_prefill import varlen_prefill

    if sliding_window is not None or softcap is not None:
        return varlen_prefill(query, key, value, cu_seqlens, scale, sliding_window, softcap)
    if cu_seqlens.numel() == 2:
        return _sdpa_causal(query, key, value, scale)
    if cu_seqlens_cpu is None or max_seqlen < SDPA_MIN_TOKENS:
        return varlen_prefill(query, key, value, cu_seqlens, scale)
    out = torch.empty_like(query)
    short: list[tuple[int, int]] = []
    for a, b in zip(cu_seqlens_cpu, cu_seqlens_cpu[1:]):
        if b - a >= SDPA_MIN_TOKENS:
            out[a:b] = _sdpa_causal(query[a:b], key[a:b], value[a:b], scale)
        elif b > a:
            short.append((a, b))
    if short:
        rows = _rows_of([a for a, _ in short], [b for _, b in short], query.device)
        offsets = [0]
        for a, b in short:
            offsets.append(offsets[-1] + b - a)
        cu = torch.tensor(offsets, dtype=torch.int32).pin_memory().to(query.device, non_blocking=True)
        out[rows] = varlen_prefill(query[rows], key[rows], value[rows], cu, scale)
    return out


def _sparse_one(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    config: SparseConfig,
    layer: int,
    out: torch.Tensor,
) -> None:
    """Sparse attention of one prompt, written into out (no [n, heads, d] temporary to copy)."""
    from tgserve.kernels.sparse.attention import sparse_prefill

    patterns = config.head_patterns(layer, query.shape[1], seq_len=query.shape[0])
    sparse_prefill(query, key, value, scale, patterns, config.block, config.last_q, use_triton=use_triton(query),
                   out=out)  # fmt: skip


def fresh_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: list[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sparse: SparseConfig | None = None,
    layer: int = 0,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prompts with no cached prefix; those of at least sparse.min_seq_len tokens go sparse.

    Sparse prefill needs the whole prompt in one step (a chunk has no future to estimate from)
    and supports neither sliding windows, softcapping nor learned sinks: such layers stay dense.
    out: where a sparse step writes its output (a dense step returns the library kernel's).
    """
    lens = [b - a for a, b in zip(cu_seqlens_cpu, cu_seqlens_cpu[1:])]
    max_len = max(lens, default=0)
    go_sparse = sparse is not None and sliding_window is None and softcap is None and sinks is None
    if not go_sparse or max_len < sparse.min_seq_len:
        return dense_prefill(query, key, value, cu_seqlens, max_len, scale, sliding_window, softcap,
                             cu_seqlens_cpu, sinks)  # fmt: skip
    out = torch.empty_like(query) if out is None else out
    for start, end in zip(cu_seqlens_cpu, cu_seqlens_cpu[1:]):
        q, k, v = query[start:end], key[start:end], value[start:end]
        if end - start >= sparse.min_seq_len:
            _sparse_one(q, k, v, scale, sparse, layer, out=out[start:end])
        elif end > start:
            cu = torch.zeros(2, dtype=torch.int32, device=query.device)
            cu[1] = end - start  # a scalar fill: no blocking host-to-device copy
            out[start:end] = dense_prefill(q, k, v, cu, end - start, scale)  # one sequence: SDPA
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of the last dim in float32: `weight * normed.to(x.dtype)`."""
    if use_triton(x):
        from tgserve.kernels.fused import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). in_place: the caller no longer needs x and residual,
    and the Triton kernel writes its outputs over them (a long prompt's step then holds two fewer
    [tokens, hidden] tensors); the twin's eager ops allocate their own either way."""
    if use_triton(x):
        from tgserve.kernels.fused import fused_add_rms_norm as triton_fused_add_rms_norm

        return triton_fused_add_rms_norm(x, residual, weight, eps, in_place)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of the last dim: x / rms(x) * (1 + weight) in float32, in x's dtype."""
    if use_triton(x):
        from tgserve.kernels.scaled_norms import gemma_rms_norm as triton_gemma_rms_norm

        return triton_gemma_rms_norm(x, weight, eps)
    return reference.gemma_rms_norm(x, weight, eps)


def float_scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`(weight * (x / rms(x))).to(x.dtype)` with the product in float32 (OLMo's RMSNorm)."""
    if use_triton(x):
        from tgserve.kernels.scaled_norms import float_scaled_rms_norm as triton_float_scaled_rms_norm

        return triton_float_scaled_rms_norm(x, weight, eps)
    return reference.float_scaled_rms_norm(x, weight, eps)


def gemma_norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual + gemma_rms_norm(x, weight), and with next_weight that sum normed by it): a
    sublayer's output into the residual stream, and the next sublayer's input."""
    if use_triton(x):
        from tgserve.kernels.scaled_norms import gemma_norm_add as triton_gemma_norm_add

        return triton_gemma_norm_add(x, residual, weight, eps, next_weight)
    return reference.gemma_norm_add(x, residual, weight, eps, next_weight)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of a fused [..., 2I] gate/up projection (Gemma)."""
    if use_triton(gate_up):
        from tgserve.kernels.fused import gelu_tanh_and_mul as triton_gelu_tanh_and_mul

        return triton_gelu_tanh_and_mul(gate_up)
    return reference.gelu_tanh_and_mul(gate_up)


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of query [T, Hq, D] and key [T, Hk, D] with cos/sin [T, 1, D] or [T, D];
    with `out`, written into those contiguous tensors (a slice of a step's rows) and returned.
    qk_norm: (query weight [D], key weight [D], eps): each head's RMSNorm before the rotation (one
    launch with it on CUDA where the weights are in the query's dtype)."""
    in_kernel = (
        use_triton(query) and qk_norm is not None and qk_norm[0].dtype == qk_norm[1].dtype == query.dtype
    )
    if qk_norm is not None and not in_kernel:  # the norms on their own, then the rotation
        query, key = rms_norm(query, qk_norm[0], qk_norm[2]), rms_norm(key, qk_norm[1], qk_norm[2])
        qk_norm = None
    if use_triton(query):
        from tgserve.kernels.fused import rotary as triton_rotary

        return triton_rotary(query, key, cos, sin, out, qk_norm)
    rotated = reference.rotary(query, key, cos, sin)
    if out is None:
        return rotated
    out[0].copy_(rotated[0])
    out[1].copy_(rotated[1])
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2I] gate/up projection."""
    if use_triton(gate_up):
        from tgserve.kernels.fused import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(gate_up)
    return reference.silu_and_mul(gate_up)


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, round_to: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router (`moe_routing.route`): softmax over every expert, the top k,
    optionally renormalised; (weights float32 [T, k], ids int64 [T, k]). round_to: the weights
    rounded to that dtype (Qwen's MoE): in it from torch, in float32 holding the same values from
    the Triton router (`fused_moe` reads either)."""
    if use_triton(logits):
        from tgserve.kernels.moe_router import route_triton, routes_in_one_launch

        if routes_in_one_launch(logits, top_k) and round_to in (None, logits.dtype):
            return route_triton(logits, top_k, renormalize, round_to_logits=round_to is not None)
    weights, ids = moe_routing.route(logits, top_k, renormalize)
    return (weights if round_to is None else weights.to(round_to)), ids


def route_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router (`moe_routing.route_top_logits`): the top k logits, then their softmax."""
    if use_triton(logits):
        from tgserve.kernels.moe_router import route_triton, routes_in_one_launch

        if routes_in_one_launch(logits, top_k):
            return route_triton(logits, top_k, softmax_first=False)
    return moe_routing.route_top_logits(logits, top_k)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    gating: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """The routed experts' SwiGLU outputs of x [T, H], weighted and summed per token: w_gate_up
    [E, 2I, H], w_down [E, H, I], routing weights [T, k] and expert ids [T, k] (`moe_routing.route`);
    gpt-oss's experts add biases (gate_up [E, 2I], down [E, H]) and gate with `ClampedSwiGLU`."""
    if use_triton(x):
        from tgserve.kernels.moe import fused_moe_triton

        return fused_moe_triton(x, w_gate_up, w_down, weights, ids, biases, gating)
    return reference.fused_moe(x, w_gate_up, w_down, weights, ids, biases, gating)


def one_row_setting(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The skinny kernel's setting for x @ weight^T where x is one unit-stride row and the device's
    measurements (`gemv_settings`) favour it at this weight's shape; None: cuBLAS's product."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return None
    from tgserve.kernels.gemv_settings import setting_for_weight

    return setting_for_weight(weight)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias, as F.linear; with weight_scale ([N, 1] float32), weight is
    fp8 and the product runs in fp8 (kernels/fp8.py)."""
    if weight_scale is not None:
        from tgserve.kernels.fp8 import fp8_linear

        return fp8_linear(x, weight, weight_scale, bias)
    setting = one_row_setting(x, weight) if use_triton(x) else None
    if setting is not None:
        from tgserve.kernels.gemv import skinny_linear

        return skinny_linear(x, weight, bias, setting)
    return torch.nn.functional.linear(x, weight, bias)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the first index of each row's maximum of x [rows, width]."""
    if use_triton(x) and x.dim() == 2 and x.shape[-1] > 0:
        from tgserve.kernels.argmax import argmax_rows

        return argmax_rows(x)
    return x.argmax(dim=-1)
