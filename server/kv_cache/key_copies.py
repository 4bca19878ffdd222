"""Device copies of host blocks' keys, in e4m3: what selective decode rescores host blocks from.

Selective decode ranks every block of a long context by its key summary, then rescores the best
`candidates` times as many as it chooses by their largest true logit, reading their keys
(`kernels/decode_selection.py`). Where the long-context tier has spilled a context's cold blocks to
host memory, those keys would cross the link every step and layer: two 512K-token contexts of
Llama-3-8B read ~670 MiB a step of candidates' keys over PCIe, twice what the chosen blocks
themselves cost (docs/benchmarks/2026-12-04-long-context-tier-h200.md). A copy of a host block's
keys on the device, quantized to e4m3 with a float32 scale per (token, KV head) as the fp8 cache
stores them, costs a quarter of a bf16 block; rescoring reads it instead, and only the chosen
blocks' keys and values cross the link. The candidates' logits then come from e4m3 keys, as they
do over an fp8 cache (the choice among them, not the attention over the chosen, is approximate).

The copies have a fixed number of slots, fewer than the host tier's blocks where the device cannot
spare more. Slots are handed out as a ring, the oldest copy giving its slot to the newest
offload: a spilling context's newest cold blocks are copied, and a host block without a copy is
rescored from host memory as before. No slot outlives its block's content: an offload into a host
block replaces whatever copy that block had.

An int8 cache's copies are its own int8 rows, as stored.

Layouts (per layer with key summaries): keys [slots, block_size, num_kv_heads, head_dim] e4m3 (int8),
scales [slots, num_kv_heads, block_size] float32; `slot_of` int32 [host blocks]: a host block's slot,
or -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgserve.kernels.fp8_format import FP8
from tgserve.kernels.kv_format import SCALED_KV_DTYPES, quantize_kv


@dataclass(frozen=True)
class LayerKeyCopy:
    """One layer's copies, and the slot map every layer shares (`dispatch.select_decode_blocks`)."""

    keys: torch.Tensor  # e4m3 or int8 (`copy_dtype`) [slots, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor  # float32 [slots, num_kv_heads, block_size]
    slot_of: torch.Tensor  # int32 [host blocks]: -1 where a host block has no copy


def key_copy_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """A block's key copy in one layer: e4m3 keys and a float32 scale a (token, KV head)."""
    return block_size * num_kv_heads * (head_dim + 4)


class HostKeyCopies:
    """The copies of every layer with key summaries, and the ring that assigns their slots."""

    def __init__(
        self, layers: list[tuple[torch.Tensor, torch.Tensor | None]], slots: int, host_blocks: int
    ) -> None:
        """layers: each such layer's (device cache [2, blocks, block_size, num_kv_heads, head_dim],
        its fp8 scales or None): what an offloaded block's keys are copied from."""
        device = layers[0][0].device
        self.sources = layers
        # One entry past the end of each map takes the writes meant for "no slot" / "no host block"
        # (-1), so `copy` needs no boolean indexing: that would wait for the device every offload.
        self._slot_of = torch.full((host_blocks + 1,), -1, dtype=torch.int32, device=device)
        self.slot_of = self._slot_of[:host_blocks]
        self._owner = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)  # a slot's host block
        self._next = 0
        self.layers = []
        for cache, _ in layers:
            _, _, block_size, num_kv_heads, head_dim = cache.shape
            keys = torch.zeros(
                slots, block_size, num_kv_heads, head_dim, dtype=copy_dtype(cache), device=device
            )
            scales = torch.zeros(slots, num_kv_heads, block_size, dtype=torch.float32, device=device)
            self.layers.append(LayerKeyCopy(keys, scales, self.slot_of))

    @property
    def num_slots(self) -> int:
        return self._owner.shape[0] - 1

    def copy(self, device_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        """Device blocks `device_ids` are being offloaded into host blocks `host_ids` (int64 device
        tensors): copy their keys into the next slots of the ring (the last slots' worth where
        more blocks than slots go at once)."""
        count = min(len(host_ids), self.num_slots)
        device_ids, host_ids = device_ids[-count:], host_ids[-count:]
        slots = (self._next + torch.arange(count, device=host_ids.device)) % self.num_slots
        self._next = (self._next + count) % self.num_slots
        # A host block written anew loses its old copy; a slot taken loses its old block.
        before = self._slot_of[host_ids].long()
        self._owner[torch.where(before >= 0, before, self.num_slots)] = -1
        previous = self._owner[slots]
        self._slot_of[torch.where(previous >= 0, previous, len(self.slot_of))] = -1
        self._owner[slots] = host_ids
        self._slot_of[host_ids] = slots.to(torch.int32)
        for (cache, scale), layer in zip(self.sources, self.layers, strict=True):
            keys, key_scales = _block_keys(cache, scale, device_ids)
            _rows(layer.keys).index_copy_(0, slots, _rows(keys))
            layer.scales.index_copy_(0, slots, key_scales)


def _block_keys(
    cache: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `ids`' keys, 8-bit [n, block_size, num_kv_heads, head_dim], and their scales [n,
    num_kv_heads, block_size]: an 8-bit cache's as stored, others quantized as the fp8 cache would."""
    if scale is not None:
        keys = _rows(cache[0]).index_select(0, ids).view(cache.dtype).view(len(ids), *cache.shape[2:])
        return keys, scale[0].index_select(0, ids)
    n, (block_size, num_kv_heads, head_dim) = len(ids), cache.shape[2:]
    keys, scales = quantize_kv(cache[0].index_select(0, ids).reshape(n * block_size, num_kv_heads, head_dim))
    return keys.view(n, block_size, num_kv_heads, head_dim), scales.view(
        n, block_size, num_kv_heads
    ).transpose(1, 2)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """tensor [n, ...] as bytes [n, -1] (torch's CPU index ops take no float8 tensors)."""
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8) if tensor.dtype == FP8 else tensor.flatten(1)


def copy_dtype(cache: torch.Tensor) -> torch.dtype:
    """What a cache's key copies hold: an 8-bit cache's own format, e4m3 for any other."""
    return cache.dtype if cache.dtype in SCALED_KV_DTYPES else FP8
