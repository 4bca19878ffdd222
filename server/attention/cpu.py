"""The cpu backend: attention in plain torch over the paged cache.

It is the reference the CUDA and HPU paths are tested against. Its pieces are the torch twins of
the kernels (tgserve.kernels.reference); on top of them it batches all decoding sequences into one
gather and uses SDPA where no softcap is needed. Grouped-query attention never repeats KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tgserve.kernels import dispatch
from tgserve.kernels.decode_selection import DecodeSelection, chosen_mask, selected_lengths
from tgserve.kernels.kv_format import dequantize_kv
from tgserve.kernels.reference import (
    causal_mask,
    current_block_from_tail,
    gather_kv,
    key_copy_slots,
    masked_attention,
    softmax_with_sinks,
    update_key_summaries,
    write_kv,
    write_tail,
)
from tgserve.server.attention.backend import AttentionBackend, AttentionLayerParams, HostBlocks, StepPlan
from tgserve.server.attention.metadata import AttentionMetadata
from tgserve.server.kv_cache.hot_blocks import admit_and_fill
from tgserve.server.kv_cache.tail_blocks import LayerTail


def attend(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    allowed: torch.Tensor | None,  # [q_len, seq_len]; None: plain causal over q_len == seq_len
    layer: AttentionLayerParams,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """One sequence's queries against its context; SDPA unless scores need softcapping or sinks.

    The inputs are made 4D: with 3D inputs torch's CPU SDPA takes its math path (20x slower at 1K
    tokens than the flash path 4D inputs get), and without a mask its flash path skips the blocks
    above the diagonal (1.5x faster than the same causal mask given explicitly).
    """
    if layer.softcap is None and layer.sinks is None:
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            key.transpose(0, 1).to(query.dtype)[None],
            value.transpose(0, 1).to(query.dtype)[None],
            attn_mask=None if allowed is None else allowed[None, None],
            is_causal=allowed is None,
            scale=layer.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    if allowed is None:
        allowed = causal_mask(query.shape[0], key.shape[0], device=query.device)
    return masked_attention(query, key, value, allowed, layer.scale, layer.softcap, sinks=layer.sinks)


@dataclass
class DecodeGroup:
    """Decoding sequences of similar context length, attended together over one padded gather."""

    rows: torch.Tensor  # flat-batch rows of their queries
    block_ids: torch.Tensor  # [B * num_blocks], row-major
    num_blocks: int
    query_pos: torch.Tensor  # [B, 1]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by sliding window
    # Selective decode: which of the group's sequences attend over chosen blocks only (bool [B]);
    # None where the step does not select.
    selected: torch.Tensor | None = None


@dataclass
class CpuStepPlan(StepPlan):
    """Decoding sequences grouped for batched gathers, prompt chunks to attend one by one, and the
    masks the layers share (built by the first layer that needs them)."""

    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_seqs: list[tuple[int, int, int, int]] = field(default_factory=list)  # (seq, begin, end, seq_len)
    writes_every_slot: bool = False  # no slot -1: keys and values go in without a mask
    prefill_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)


def cpu_step_plan(metadata: AttentionMetadata, selection: DecodeSelection | None = None) -> CpuStepPlan:
    """With a selection, every decoding sequence past its threshold selects, whatever else the step
    holds (a request's tokens never depend on the requests batched with it)."""
    starts, lens, block_size = metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_size
    decode = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
    # Sequences whose block counts fall in the same power-of-two range share a gather, so padding
    # to the longest in a group at most doubles what is read (mixed lengths would pad far more).
    # A group of one still beats the per-sequence path (a per-token slot gather and a mask).
    buckets: dict[int, list[int]] = {}
    for i in decode:
        buckets.setdefault((-(-lens[i] // block_size) - 1).bit_length(), []).append(i)
    groups = [_decode_group(metadata, seqs, block_size) for seqs in buckets.values()]
    if selection is not None and selection.selects(metadata.max_seq_len):
        for group in groups:
            group.selected = group.query_pos[:, 0] + 1 > selection.min_context
    grouped = {i for seqs in buckets.values() for i in seqs}
    # Sequences without queries (padding of a static-shape step) have nothing to attend.
    prefill = [
        (i, starts[i], starts[i + 1], n)
        for i, n in enumerate(lens)
        if i not in grouped and starts[i + 1] > starts[i]
    ]
    return CpuStepPlan(metadata, groups, prefill, bool((metadata.slot_mapping >= 0).all()))


def _decode_group(metadata: AttentionMetadata, seqs: list[int], block_size: int) -> DecodeGroup:
    device = metadata.slot_mapping.device
    index = torch.tensor(seqs, device=device)
    num_blocks = -(-max(metadata.seq_lens_cpu[i] for i in seqs) // block_size)
    return DecodeGroup(
        rows=torch.tensor([metadata.query_start_loc_cpu[i] for i in seqs], device=device),
        block_ids=metadata.block_tables[index, :num_blocks].reshape(-1).long(),
        num_blocks=num_blocks,
        query_pos=(metadata.seq_lens[index].long() - 1)[:, None],
    )


def decode_mask(group: DecodeGroup, block_size: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, L] True where a decode query may attend (causal, window), cached per window."""
    if sliding_window not in group.masks:
        positions = torch.arange(group.num_blocks * block_size, device=group.query_pos.device)[None, :]
        allowed = positions <= group.query_pos
        if sliding_window is not None:
            allowed &= positions > group.query_pos - sliding_window
        group.masks[sliding_window] = allowed[:, None, None, :]
    return group.masks[sliding_window]


def block_rows(
    pool: torch.Tensor, host_pool: torch.Tensor | None, first: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows `ids` of `pool` [blocks, ...] (index_select along dim 0: a row memcpy), ids from
    `first` on taken from `host_pool` (the same layout, strided by host block) instead."""
    if host_pool is None:
        return pool.index_select(0, ids)
    on_host = ids >= first
    rows = pool.index_select(0, torch.where(on_host, 0, ids))
    if on_host.any():
        rows[on_host] = host_pool.index_select(0, ids[on_host] - first)
    return rows


def _side(tensor: torch.Tensor | None, i: int, as_bytes: bool) -> torch.Tensor | None:
    """Side i (keys 0, values 1) of a pool tensor [2, blocks, ...], as bytes for an 8-bit cache
    (torch's CPU indexing ops do not take float8 tensors)."""
    if tensor is None:
        return None
    return tensor[i].view(torch.uint8) if as_bytes else tensor[i]


def paged_blocks(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, host: HostBlocks | None, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [len(ids) * block_size, H_kv, D] of blocks `ids` (host blocks among them
    read from the host tier), dequantized to float32 from an 8-bit cache."""
    scaled, first = kv_scale is not None, kv_cache.shape[1] if host is None else host.first
    out = []
    for i in (0, 1):
        pool, host_pool = _side(kv_cache, i, scaled), _side(None if host is None else host.cache, i, scaled)
        rows = block_rows(pool.flatten(1), None if host_pool is None else host_pool.flatten(1), first, ids)
        values = rows.view(ids.shape[0] * kv_cache.shape[2], *kv_cache.shape[3:])
        if scaled:
            scales = block_rows(kv_scale[i], None if host is None else host.scale[i], first, ids)
            values = dequantize_kv(
                values.view(kv_cache.dtype), scales.transpose(1, 2).reshape(-1, scales.shape[1])
            )
        out.append(values)
    return out[0], out[1]


def gathered_blocks(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, group: DecodeGroup, host: HostBlocks | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values [B, L, H_kv, D], L = num_blocks * block_size: whole blocks
    gathered as rows of a 2D view, no per-token slots (index_select along dim 0 of a 2D tensor is a
    row memcpy, 15 GB/s on two cores; along dim 1 of the [2, blocks, -1] view it ran at 2.8 GB/s).
    From an 8-bit cache they come dequantized, in float32; blocks spilled to host from `host`."""
    batch = group.query_pos.shape[0]
    keys, values = paged_blocks(kv_cache, kv_scale, host, group.block_ids)
    if host is not None and host.hot is not None:
        keys, values = _with_held_heads(keys, values, kv_cache, kv_scale, host, group.block_ids)
    return keys.view(batch, -1, *keys.shape[1:]), values.view(batch, -1, *values.shape[1:])


def with_current_tails(
    keys: torch.Tensor, values: torch.Tensor, group: DecodeGroup, tail: LayerTail
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's gathered keys and values [B, L, H_kv, D] with each sequence's current block
    read from its tail slot where it has one (`reference.current_block_from_tail`, batched)."""
    batch, block_size = keys.shape[0], tail.cache.shape[2]
    columns = group.query_pos[:, 0] // block_size
    blocks = group.block_ids.view(batch, group.num_blocks)[torch.arange(batch), columns]
    slots = tail.slot_of[blocks.clamp(max=tail.slot_of.shape[0] - 1)].long()
    slots = torch.where(blocks < tail.slot_of.shape[0], slots, -1)
    rows = (slots >= 0).nonzero()[:, 0]
    if rows.numel() == 0:
        return keys, values
    shape = (batch, group.num_blocks, block_size, *keys.shape[2:])
    for side, gathered in enumerate((keys, values)):
        gathered.view(shape)[rows, columns[rows]] = tail.cache[side, slots[rows]].to(gathered.dtype)
    return keys, values


def _with_held_heads(
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    host: HostBlocks,
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys and values [len(ids) * block_size, H_kv, D] with every KV head of a host block that
    the hot-block cache holds read from its device block, as the CUDA decode kernel reads it."""
    on_host = ids >= host.first
    held = host.hot.map[:, torch.where(on_host, ids - host.first, host.hot.none_block)].long()
    held = torch.where(on_host[None, :], held, -1)  # [H_kv, len(ids)]
    if not bool((held >= 0).any()):
        return keys, values
    shape = (len(ids), kv_cache.shape[2], *keys.shape[1:])
    keys, values = keys.view(shape).clone(), values.view(shape).clone()
    for head, row in enumerate(held):
        at = (row >= 0).nonzero()[:, 0]
        if at.numel():
            cached_keys, cached_values = paged_blocks(kv_cache, kv_scale, None, row[at])
            keys[at, :, head] = cached_keys.view(len(at), *shape[1:])[:, :, head].to(keys.dtype)
            values[at, :, head] = cached_values.view(len(at), *shape[1:])[:, :, head].to(values.dtype)
    return keys.flatten(0, 1), values.flatten(0, 1)


def sequence_kv(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    host: HostBlocks | None,
    table: torch.Tensor,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` keys and values (`reference.gather_kv`, host blocks read in
    place)."""
    if host is None:
        return gather_kv(kv_cache, table, length, kv_scale)
    ids = table[: -(-length // kv_cache.shape[2])].long()
    keys, values = paged_blocks(kv_cache, kv_scale, host, ids)
    return keys[:length], values[:length]


def chosen_positions(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: DecodeGroup,
    layer: AttentionLayerParams,
    selection: DecodeSelection,
) -> torch.Tensor:  # bool [B, num_heads, 1, L]
    """Selective decode as a mask over the group's gathered positions: per KV head, the blocks
    `dispatch.select_decode_blocks` chooses and the current one (every block for a sequence not
    selected), repeated for the query heads that share it. With every block chosen it is all True,
    and attention is the dense one."""
    batch, num_blocks, block_size = group.query_pos.shape[0], group.num_blocks, kv_cache.shape[2]
    tables = group.block_ids.view(batch, num_blocks)
    seq_lens = group.query_pos[:, 0] + 1
    summary, cache, scale = layer.key_summary, kv_cache, layer.kv_scale
    if layer.host is not None and bool((group.block_ids >= layer.host.first).any()):
        # Blocks on host among them: select over the group's own blocks.
        summary, cache, scale, tables = _group_blocks(kv_cache, group, layer)
    chosen = dispatch.select_decode_blocks(query, summary, tables, seq_lens, selection, cache, scale)
    if layer.host is not None and layer.host.hot is not None:
        lengths = selected_lengths(seq_lens, chosen.shape[2] + 1, block_size, group.selected)
        admit_and_fill(layer.host.hot, chosen, group.block_ids.view(batch, num_blocks), lengths, kv_cache,
                       layer.kv_scale, layer.host.cache, layer.host.scale)  # fmt: skip
    keep = chosen_mask(chosen, seq_lens, num_blocks, block_size) | ~group.selected[:, None, None]
    group_size = query.shape[1] // keep.shape[1]
    return keep.repeat_interleave(group_size, 1).repeat_interleave(block_size, 2)[:, :, None, :]


def _group_blocks(
    kv_cache: torch.Tensor, group: DecodeGroup, layer: AttentionLayerParams
) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    """The group's blocks as a pool of their own (key summaries, keys and values, dequantized from
    an 8-bit cache) and the tables that read it, block-table columns unchanged: selection over
    blocks some of which lie in the host tier."""
    host, ids = layer.host, group.block_ids
    summary = torch.stack(
        [block_rows(layer.key_summary[i], host.summary[i], host.first, ids) for i in (0, 1)]
    )
    keys, values = paged_blocks(kv_cache, layer.kv_scale, host, ids)
    if host.key_copy is not None:  # the candidates' keys, as the GPU's rescoring reads them
        keys = _with_key_copies(keys, host, ids)
    cache = torch.stack([keys, values]).view(2, ids.shape[0], *kv_cache.shape[2:])
    tables = torch.arange(ids.shape[0], dtype=torch.int32, device=ids.device).view(-1, group.num_blocks)
    return summary, cache, None, tables


def _with_key_copies(keys: torch.Tensor, host: HostBlocks, ids: torch.Tensor) -> torch.Tensor:
    """keys [len(ids) * block_size, H_kv, D] with those of host blocks that have a device copy
    (`HostKeyCopies`) replaced by the copy, dequantized."""
    copy = host.key_copy
    slots = key_copy_slots(ids, host.first, copy.slot_of)
    copied = slots >= 0
    if not bool(copied.any()):
        return keys
    chosen = slots[copied]
    stored = copy.keys.view(torch.uint8).index_select(0, chosen).view(copy.keys.dtype)
    scales = copy.scales.index_select(0, chosen).transpose(1, 2)  # [n, block_size, H_kv]
    blocks = keys.view(len(ids), -1, *keys.shape[1:]).clone()
    blocks[copied] = dequantize_kv(stored, scales).to(keys.dtype)
    return blocks.view(keys.shape)


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]: one query per sequence, at position seq_len - 1
    kv_cache: torch.Tensor,
    group: DecodeGroup,
    layer: AttentionLayerParams,
    selection: DecodeSelection | None = None,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """A group of decoding sequences at once: whole blocks gathered, padded to the longest, masked
    (and, selecting, masked to the chosen blocks)."""
    batch, num_heads, dim = query.shape
    block_size = kv_cache.shape[2]
    allowed = decode_mask(group, block_size, layer.spec.sliding_window)
    if group.selected is not None and layer.key_summary is not None:
        allowed = allowed & chosen_positions(query, kv_cache, group, layer, selection)
    keys, values = gathered_blocks(kv_cache, layer.kv_scale, group, layer.host)
    if layer.tail is not None:
        keys, values = with_current_tails(keys, values, group, layer.tail)
    if layer.softcap is None and layer.sinks is None:
        out = F.scaled_dot_product_attention(
            query[:, :, None, :],
            keys.transpose(1, 2).to(query.dtype),
            values.transpose(1, 2).to(query.dtype),
            attn_mask=allowed,
            scale=layer.scale,
            enable_gqa=True,
        )
        return out[:, :, 0, :]
    num_kv = keys.shape[2]
    q = query.float().view(batch, num_kv, num_heads // num_kv, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", q, keys.float()) * layer.scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if allowed.shape[1] > 1:  # per query head (selection): [B, num_kv, group, L] like the scores
        allowed = allowed.view(batch, num_kv, -1, allowed.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    sinks = None if layer.sinks is None else layer.sinks.view(1, num_kv, -1, 1)
    out = torch.einsum("bkgl,blkd->bkgd", softmax_with_sinks(scores, sinks), values.float())
    return out.reshape(batch, num_heads, dim).to(query.dtype)


class CpuAttentionBackend(AttentionBackend[CpuStepPlan]):
    """Paged attention in torch: decoding sequences batched together, prefill chunks one at a time."""

    name = "cpu"
    reads_scaled_kv = True
    reads_host_blocks = True

    def __init__(self, selection: DecodeSelection | None = None) -> None:
        self.selection = selection

    def plan(self, metadata: AttentionMetadata) -> CpuStepPlan:
        return cpu_step_plan(metadata, self.selection)

    def forward(self, query, key, value, kv_cache, plan: CpuStepPlan, layer: AttentionLayerParams):
        metadata = plan.metadata
        if layer.kv_scale is not None:  # an 8-bit cache: each row quantized with its own scale
            write_kv(key, value, kv_cache, metadata.slot_mapping, layer.kv_scale)
            if layer.tail is not None:
                write_tail(key, value, metadata.slot_mapping, layer.tail_args)
        elif plan.writes_every_slot:
            flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
            flat[0].index_copy_(0, metadata.slot_mapping, key.to(kv_cache.dtype))
            flat[1].index_copy_(0, metadata.slot_mapping, value.to(kv_cache.dtype))
        else:
            write_kv(key, value, kv_cache, metadata.slot_mapping)
        if layer.key_summary is not None:
            update_key_summaries(key, metadata.slot_mapping, layer.key_summary, metadata.block_size)
        out = torch.empty_like(query)
        for group in plan.decode_groups:
            out[group.rows] = decode_attention(query[group.rows], kv_cache, group, layer, self.selection)
        window = layer.spec.sliding_window
        for i, begin, end, seq_len in plan.prefill_seqs:
            fresh = end - begin == seq_len  # a fresh prompt: its context is exactly this step's keys
            if fresh:
                k, v = key[begin:end], value[begin:end]
            else:
                k, v = sequence_kv(kv_cache, layer.kv_scale, layer.host, metadata.block_tables[i], seq_len)
                if layer.tail is not None:
                    k, v = current_block_from_tail(k, v, metadata.block_tables[i], seq_len, layer.tail_args)
            if fresh and window is None:
                allowed = None
            elif (i, window) in plan.prefill_masks:
                allowed = plan.prefill_masks[i, window]
            else:
                allowed = plan.prefill_masks[i, window] = causal_mask(
                    end - begin, seq_len, window, query.device
                )
            out[begin:end] = attend(query[begin:end], k, v, allowed, layer)
        return out
