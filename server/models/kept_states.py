"""State kept between steps for models whose layers hold state besides keys and values.

Such models (Mamba, RWKV, linear-attention and convolutional hybrids) run through
`recompute_fallback.py`: the paged cache keeps each sequence's token ids. Recomputing the whole
sequence for every token is correct but costs a forward over the sequence a step. transformers'
own cache object, after a forward over a sequence's tokens, is the state that lets the next token
cost one token's forward, exactly as `generate` runs. So it is kept here, keyed by the tokens it was
built from, and taken by the step whose sequence is those tokens plus one.

Keying by content rather than by request keeps the engine's correctness where it comes from: a
sequence whose tokens changed (preempted and recomputed, a prefix hit, a prompt in chunks) finds no
state for its tokens and is recomputed. Kept states are bounded by count and by bytes (the memory
the pool would otherwise have used), the least recently kept evicted first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import torch

TokenKey = tuple[int, bytes]  # (length, digest of the ids)


def token_key(ids: torch.Tensor) -> TokenKey:
    """A key for a token sequence (int64 ids on the CPU): its length and a 128-bit digest of its
    ids, so a kept state is found only by the tokens it was built from (a digest, not the ids
    themselves: a key is kept per sequence, and sequences may be long)."""
    return prefix_and_whole_keys(ids)[1]


def prefix_and_whole_keys(ids: torch.Tensor) -> tuple[TokenKey, TokenKey]:
    """`token_key` of all but the last id and of all of them, the ids read once: the key a step
    looks its state up by, and the one it keeps the continued state under."""
    digest = hashlib.blake2b(ids[:-1].numpy().tobytes(), digest_size=16)
    prefix = (ids.numel() - 1, digest.digest())
    digest.update(ids[-1:].numpy().tobytes())
    return prefix, (ids.numel(), digest.digest())


def state_bytes(state: Any) -> int:
    """Bytes of the tensors a kept state holds: transformers' caches keep them in lists of layers,
    each an object with tensor attributes, or in lists of tensors; walked to a few levels, each
    storage counted once."""
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> int:
        if isinstance(obj, torch.Tensor):
            if obj.untyped_storage().data_ptr() in seen:
                return 0
            seen.add(obj.untyped_storage().data_ptr())
            return obj.untyped_storage().nbytes()
        if depth == 0:
            return 0
        if isinstance(obj, dict):
            return sum(walk(value, depth - 1) for value in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(walk(value, depth - 1) for value in obj)
        if hasattr(obj, "__dict__"):
            return sum(walk(value, depth - 1) for value in vars(obj).values())
        return 0

    return walk(state, 4)


class KeptStates:
    """States by the tokens they were built from: `take` removes the one for a key (a state is
    continued in place, so it serves one sequence's next step only), `keep` adds one. Several
    sequences may hold the same tokens (one prompt sampled several ways): each gets a state."""

    def __init__(self, max_states: int, max_bytes: int) -> None:
        self.max_states, self.max_bytes = max_states, max_bytes
        self._states: OrderedDict[int, tuple[TokenKey, Any, int]] = OrderedDict()  # by entry number
        self._by_key: dict[TokenKey, list[int]] = {}
        self._entries = 0
        self.bytes = 0
        self.hits = self.misses = 0  # steps that continued a kept state, and that recomputed

    def __len__(self) -> int:
        return len(self._states)

    def take(self, key: TokenKey) -> Any | None:
        entries = self._by_key.get(key)
        if not entries:
            self.misses += 1
            return None
        self.hits += 1
        return self._remove(entries[-1])

    def keep(self, key: TokenKey, state: Any) -> None:
        size = state_bytes(state)
        if size > self.max_bytes or self.max_states <= 0:
            return
        while self._states and (len(self._states) >= self.max_states or self.bytes + size > self.max_bytes):
            self._remove(next(iter(self._states)))
        self._entries += 1
        self._states[self._entries] = (key, state, size)
        self._by_key.setdefault(key, []).append(self._entries)
        self.bytes += size

    def clear(self) -> None:
        self._states.clear()
        self._by_key.clear()
        self.bytes = 0

    def _remove(self, entry: int) -> Any:
        key, state, size = self._states.pop(entry)
        entries = self._by_key[key]
        entries.remove(entry)
        if not entries:
            del self._by_key[key]
        self.bytes -= size
        return state
