"""For HF models that bypass `AttentionInterface`: a `Cache` that stores into the paged KV pool.

Such models call `past_key_values.update(key, value, layer_idx)` and attend over what it returns.
The adapter writes the step's keys and values at their slots, then returns every scheduled
sequence's whole context concatenated, and `packed_context_mask` lets each query see only its own
sequence's earlier keys (and its window). It costs a gather per layer and a [T, sum(context)] mask,
which is why models that use `AttentionInterface` do not go this way.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from tgserve.kernels.reference import causal_mask, current_block_from_tail, gather_kv, write_kv, write_tail
from tgserve.server.attention.forward_context import ForwardContext
from tgserve.server.loading.hf_compat import empty_cache_init_kwargs


class PagedCacheAdapter(Cache):
    def __init__(self, ctx: ForwardContext) -> None:
        super().__init__(**empty_cache_init_kwargs())
        self.ctx = ctx

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        # key_states [1, H_kv, T, D] -> [T, H_kv, D]. What else the model passes (transformers 4.x's
        # `cache_kwargs`, 5.x's `kwargs=`: rotary sin/cos, cache positions) is not needed here.
        kv_cache, kv_scale, meta = (
            self.ctx.kv_caches[layer_idx],
            self.ctx.kv_scale(layer_idx),
            self.ctx.metadata,
        )
        key, value = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        write_kv(key, value, kv_cache, meta.slot_mapping, kv_scale)
        tail = self.ctx.tail(layer_idx)  # an 8-bit cache's full-precision tail (kv_cache/tail_blocks.py)
        if tail is not None:
            write_tail(key, value, meta.slot_mapping, tail.as_kernel_args)
        keys, values = [], []
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            begin, end = starts[i], starts[i + 1]
            if end - begin == seq_len:  # a fresh prompt: its context is this step's keys
                k, v = (s[0, :, begin:end].transpose(0, 1) for s in (key_states, value_states))
            else:
                k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len, kv_scale)
                if tail is not None:
                    k, v = current_block_from_tail(k, v, meta.block_tables[i], seq_len, tail.as_kernel_args)
            keys.append(k)
            values.append(v)
        packed_k = torch.cat(keys).transpose(0, 1)[None].to(key_states.dtype)
        packed_v = torch.cat(values).transpose(0, 1)[None].to(value_states.dtype)
        return packed_k, packed_v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly

    def get_mask_sizes(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise RuntimeError("the paged cache adapter is used with an explicit 4D mask only")


def packed_context_mask(ctx: ForwardContext, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, num_tokens, sum(seq_lens)] additive mask: 0 where a query may attend, the dtype's min elsewhere.

    Sliding windows are per layer but this mask is shared by all layers, so models on this path
    must use full attention; the engine checks that when it loads one.
    """
    meta = ctx.metadata
    device = meta.slot_mapping.device
    total = sum(meta.seq_lens_cpu)
    # Every token of the step has a row; padding tokens of a static-shape step (after the last
    # sequence's queries) attend to nothing that matters and their rows are never read.
    allowed = torch.zeros(meta.slot_mapping.shape[0], total, dtype=torch.bool, device=device)
    column = 0
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        begin, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        allowed[begin:end, column : column + seq_len] = causal_mask(end - begin, seq_len, None, device)
        column += seq_len
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
