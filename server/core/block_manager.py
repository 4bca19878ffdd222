"""Paged KV-cache bookkeeping: which blocks each request owns, reference counts and prefix caching.

Plain Python over `Request` objects; the tensors live in the model runner, which only ever sees
block ids. Block 0 is an ordinary block: nothing here needs a reserved "null" block, and a runner
that wants a scratch block for padded (CUDA-graph) slots uses slot -1 or sizes its pool one larger.

The long-context tier (`spill`): a request whose context outgrows the device pool moves its cold
blocks (not its first, attention's sink, nor its last, the recent window it writes into) to host
blocks held for it. Its block list then names them as `num_total_blocks + host block`, ids past the
device pool's, which the attention backend reads in place (`HostKVPool.layer_views`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tgserve.server.core.host_tier import BlockHash, HostTier, KVTransfers
from tgserve.server.core.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """The cached start of a request's tokens: device blocks, then host blocks that continue them
    (loaded into fresh device blocks when the request is admitted), `num_tokens` in all."""

    block_ids: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class _Block:
    """One block of `block_size` KV slots. A block with a hash holds a full, reusable prefix block."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """Chain a full block's tokens onto its parent's hash, so equal blocks match only after equal prefixes."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Owns the pool of `num_blocks` KV blocks of `block_size` tokens each.

    Each request (by id) owns an ordered list of blocks; block i holds its tokens
    [i * block_size, (i + 1) * block_size). Blocks are reference counted so that requests with a
    common prefix share the full blocks of that prefix. A free block keeps its hash (its KV stays
    valid) until it is reused for something else, so a finished request's prefix can still be hit.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostTier | None = None,
        spill_keep: tuple[int, int] | None = None,
        first_host_id: int | None = None,
    ) -> None:
        """spill_keep: (first, last) blocks of a request that `spill` never moves to host; None:
        requests never spill (the attention backend cannot read host blocks). first_host_id: the
        block id of host block 0 in a request's block list (default num_blocks: the pool's device
        blocks past the block manager's, such as the hot-block cache's, come before it)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self.first_host_id = num_blocks if first_host_id is None else first_host_id
        assert self.first_host_id >= num_blocks
        # Free blocks in reuse order (front first). An OrderedDict gives O(1) removal of a cached
        # block from the middle when a new request touches it.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[BlockHash, int] = {}
        self._req_blocks: dict[str, list[int]] = {}
        # Per request: hashes of its full blocks computed so far (tokens only grow, so they stay valid).
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # Per request: how many of its leading blocks are already registered in the cache.
        self._req_num_cached_blocks: dict[str, int] = {}
        # Requests whose lookup was counted since they were (re)queued: the scheduler may look a
        # waiting request up on several steps before it fits, and that is one query, not several.
        self._lookups_counted: set[str] = set()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Full blocks evicted from the pool go to host memory, and come back from there (host_tier.py);
        # without prefix caching, the host tier still takes swapped-out and spilled blocks.
        self.host_tier = host_tier
        self.host_hits = 0  # prompt tokens loaded from the host tier instead of computed
        self._swapped: dict[str, list[int]] = {}  # request id -> the host blocks holding its KV
        self.spill_keep = spill_keep if self.host_tier is not None else None
        self._moved: dict[str, list[tuple[int, int]]] = {}  # spilled since the last step: (index, new id)

    def reset_counters(self) -> None:
        """Zero the prefix cache's lookup counts (the cache's contents stay)."""
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_hits = 0
        if self.host_tier is not None:
            self.host_tier.counters = type(self.host_tier.counters)()

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks owned by no request (some of them may still hold cached prefixes)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool owned by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def max_tokens_in_pool(self) -> int:
        """The most tokens one request can ever hold: a longer prompt must be rejected up front.
        Spilling, the host tier's blocks count too (all of them: cached prefixes give way)."""
        host = self.host_tier.capacity if self.spill_keep is not None else 0
        return (self.num_total_blocks + host) * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in token order (a copy; empty for an unknown request)."""
        return list(self._req_blocks.get(request_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks that matches the start of the request's tokens.

        Returns (block_ids, num_computed_tokens). At least one token is always left to compute,
        because the step that computes it is the one that produces the next token's logits.
        Allocates nothing: pass the blocks to `allocate_slots`, and what the request is admitted
        with to `count_lookup`.
        """
        if not self._looks_up(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in self._block_hashes(request, max_blocks):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """`get_computed_blocks`, continued into the host tier: the blocks after the device's run
        that host memory holds. Allocates nothing: pass the hit to `allocate_slots`."""
        block_ids, num_tokens = self.get_computed_blocks(request)
        if self.host_tier is None or not self._looks_up(request):
            return PrefixHit(block_ids, [], num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        host_blocks: list[int] = []
        for block_hash in self._block_hashes(request, max_blocks)[len(block_ids) :]:
            host_block = self.host_tier.lookup(block_hash)
            if host_block is None:
                break
            host_blocks.append(host_block)
        return PrefixHit(block_ids, host_blocks, num_tokens + len(host_blocks) * self.block_size)

    def take_kv_transfers(self) -> KVTransfers:
        """The block copies that this step's allocations made (empty without a host tier)."""
        return KVTransfers() if self.host_tier is None else self.host_tier.take_transfers()

    def _looks_up(self, request: Request) -> bool:
        # Prompt log-probabilities need every prompt position computed.
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def count_lookup(self, request: Request, num_computed: int, from_host: int = 0) -> None:
        """Count an admitted request's prompt as prefix-cache queries and the `num_computed` tokens
        it takes from the cache as hits (`from_host` of them loaded from the host tier), in tokens,
        once per request until it is freed."""
        if self._looks_up(request) and request.request_id not in self._lookups_counted:
            self._lookups_counted.add(request.request_id)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
            self.host_hits += from_host

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the hashes of the request's blocks that computed tokens now fill completely."""
        if not self.enable_prefix_caching:
            return
        block_ids = self._req_blocks.get(request.request_id)
        if block_ids is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(block_ids))
        start = self._req_num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            if block_ids[i] >= self.first_host_id:
                continue  # spilled to host: out of the device prefix cache
            block = self._blocks[block_ids[i]]
            # Two requests that computed the same prefix at once hold equal blocks; the first one
            # registered stays the cached copy and the other is simply not findable.
            if block.block_hash is None and hashes[i] not in self._hash_to_block:
                block.block_hash = hashes[i]
                self._hash_to_block[hashes[i]] = block.block_id
        self._req_num_cached_blocks[request.request_id] = num_full

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first num_blocks full blocks, extending the memo as needed."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, tuple(tokens[i * size : (i + 1) * size])))
        return hashes[:num_blocks]

    # ---- allocation ----------------------------------------------------------------------------

    def num_fitting_tokens(
        self, request: Request, computed_blocks: list[int] | None = None, host_blocks: list[int] | None = None
    ) -> int:
        """How many new tokens `allocate_slots` could give the request now, past its computed tokens
        and the prefix hit's blocks (`computed_blocks` on the device, `host_blocks` loaded)."""
        owned = self._req_blocks.get(request.request_id, [])
        computed, num_loaded = list(computed_blocks or ()), len(host_blocks or ())
        revived = sum(1 for b in computed if self._blocks[b].ref_count == 0)
        blocks = len(owned) + len(computed) + self.num_free_blocks - revived
        return (
            blocks * self.block_size
            - request.num_computed_tokens
            - (len(computed) + num_loaded) * self.block_size
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        host_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Make the request own enough blocks for its computed tokens plus num_new_tokens.

        computed_blocks and host_blocks (a `PrefixHit`'s) are only accepted for a request that owns
        no blocks yet; their tokens count as computed. Each host block is loaded into a fresh
        device block this step, which joins the prefix cache at once. Returns the block ids newly
        added to the request (the computed and loaded ones first), or None when the pool is short,
        in which case nothing changes.
        """
        request_id = request.request_id
        owned = self._req_blocks.get(request_id, [])
        computed, loaded = list(computed_blocks or ()), list(host_blocks or ())
        if (computed or loaded) and owned:
            raise ValueError(
                f"request {request_id!r} already owns blocks; computed_blocks are for a fresh one"
            )
        num_hit = len(computed) + len(loaded)
        num_tokens = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        num_fresh = self.num_blocks_for(num_tokens) - len(owned) - len(computed)
        # A cached block that nobody owns sits in the free list: touching it uses up a free block.
        num_revived = sum(1 for b in computed if self._blocks[b].ref_count == 0)
        if max(num_fresh, 0) + num_revived > self.num_free_blocks:
            return None
        for block_id in computed:
            self._touch(block_id)
        if loaded:  # before taking blocks, whose evictions offer blocks to the host tier
            self.host_tier.reserve(loaded)
        fresh = self._take_free_blocks(max(num_fresh, 0))
        if loaded:
            self._load_from_host(request, len(computed), loaded, fresh[: len(loaded)])
        new_blocks = computed + fresh
        if request_id not in self._req_blocks:
            self._req_blocks[request_id] = []
            self._req_num_cached_blocks[request_id] = num_hit
        self._req_blocks[request_id].extend(new_blocks)
        return new_blocks

    def _load_from_host(
        self, request: Request, first: int, host_blocks: list[int], targets: list[int]
    ) -> None:
        """Plan the loads of a request's host-tier blocks (its blocks first, first + 1, ...) into
        `targets` and cache those under their hashes: the copies run before the step's forward."""
        hashes = self._block_hashes(request, first + len(host_blocks))
        for i, (host_block, block_id) in enumerate(zip(host_blocks, targets, strict=True)):
            self.host_tier.load(host_block, block_id)
            block_hash = hashes[first + i]
            if block_hash not in self._hash_to_block:
                self._blocks[block_id].block_hash = block_hash
                self._hash_to_block[block_hash] = block_id

    # ---- swapping to the host tier -----------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Preemption without recomputation: copy the request's blocks to host blocks held for it
        (this step, before anything overwrites them) and free them here. False, changing nothing,
        without a host tier that can hold them all, or for a request with blocks spilled to host."""
        blocks = self._req_blocks.get(request.request_id, [])
        spilled = any(block_id >= self.first_host_id for block_id in blocks)
        held = None if self.host_tier is None or not blocks or spilled else self.host_tier.hold(blocks)
        if held is None:
            return False
        self.free(request)
        self._swapped[request.request_id] = held
        return True

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Blocks for a swapped-out request's computed tokens, loaded from its host blocks this
        step, plus room for `num_new_tokens`; None, changing nothing, when the pool is short."""
        held = self._swapped[request.request_id]
        num_blocks = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        if max(num_blocks, len(held)) > self.num_free_blocks:
            return None
        self.host_tier.reserve(held)  # before taking blocks, whose evictions offer to the tier
        blocks = self._take_free_blocks(max(num_blocks, len(held)))
        self.host_tier.load_held(held, blocks[: len(held)])
        del self._swapped[request.request_id]
        self._req_blocks[request.request_id] = blocks
        self._req_num_cached_blocks[request.request_id] = 0  # their hashes are registered as they fill
        self._lookups_counted.add(request.request_id)  # counted when it was first admitted
        return blocks

    # ---- the long-context tier -------------------------------------------------------------------

    def spillable_blocks(self, request: Request, num_computed: int | None = None) -> list[int]:
        """Where the request's cold blocks are in its block list, oldest first: full of computed
        tokens (its `num_computed_tokens`, or the `num_computed` written so far), its own alone, on
        the device, not among the first and last `spill_keep`; none without spilling."""
        if self.spill_keep is None:
            return []
        first, last = self.spill_keep
        owned = self._req_blocks.get(request.request_id, [])
        computed = request.num_computed_tokens if num_computed is None else num_computed
        num_full = min(computed // self.block_size, len(owned) - last)
        return [
            i
            for i in range(first, num_full)
            if owned[i] < self.first_host_id and self._blocks[owned[i]].ref_count == 1
        ]

    def spill(self, request: Request, count: int, num_computed: int | None = None) -> bool:
        """Move `count` of the request's oldest cold blocks (`spillable_blocks`) to host blocks
        held for it, freeing their device blocks; the copies run before the step's forward, ahead
        of anything that writes the freed blocks. False, changing nothing, when spilling is off or
        the request or the host tier lacks that many."""
        cold = self.spillable_blocks(request, num_computed)
        if count <= 0 or len(cold) < count:
            return False
        chosen = cold[:count]
        owned = self._req_blocks[request.request_id]
        held = self.host_tier.hold([owned[i] for i in chosen], swap=False)
        if held is None:
            return False
        moved = self._moved.setdefault(request.request_id, [])
        for i, host_block in zip(chosen, held, strict=True):
            block = self._blocks[owned[i]]
            if block.block_hash is not None:  # its KV leaves the device: no longer a cached prefix
                del self._hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)  # reused first: it holds nothing now
            owned[i] = self.first_host_id + host_block
            moved.append((i, owned[i]))
        return True

    def take_moved(self, request_id: str) -> list[tuple[int, int]]:
        """The request's blocks spilled since the last call: (index in its block list, new id)."""
        return self._moved.pop(request_id, [])

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody else owns go back to the free list.

        Blocks are released tail first, so the end of a prefix (the part least likely to be shared)
        is evicted before its beginning. Safe to call for a request that owns nothing. A swapped-out
        request's host blocks are given back.
        """
        request_id = request.request_id
        if request_id in self._swapped:
            self.host_tier.release(self._swapped.pop(request_id))
        self._moved.pop(request_id, None)
        # Lookups bound once: a 128K-token prompt frees 8,192 blocks on its way to its only token.
        blocks, free_list, first_host = self._blocks, self._free, self.first_host_id
        to_front = free_list.move_to_end
        owned = self._req_blocks.pop(request_id, [])
        if spilled := [b - first_host for b in owned if b >= first_host]:
            self.host_tier.release(spilled)
        for block_id in reversed(owned):
            if block_id >= first_host:
                continue
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                free_list[block_id] = None
                if block.block_hash is None:
                    # A block without a hash holds nothing reusable: hand it out before any cached block.
                    to_front(block_id, last=False)
        self._req_hashes.pop(request_id, None)
        self._req_num_cached_blocks.pop(request_id, None)
        self._lookups_counted.discard(request_id)

    def _touch(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free_blocks(self, count: int) -> list[int]:
        """Pop the `count` least recently freed blocks, evicting the prefixes they cached. One loop
        with its lookups bound once: a 128K-token prompt takes 8,192 blocks before its first kernel."""
        pop, blocks, cached = self._free.popitem, self._blocks, self._hash_to_block
        taken = []
        for _ in range(count):
            block_id, _ = pop(last=False)
            block = blocks[block_id]
            if block.block_hash is not None:
                # A block carries a hash only while the cache maps that hash to it (cache_full_blocks).
                del cached[block.block_hash]
                if self.host_tier is not None:  # its KV is written to host before the step overwrites it
                    self.host_tier.offer(block.block_hash, block_id)
                block.block_hash = None
            block.ref_count = 1
            taken.append(block_id)
        return taken
