"""Block and slot allocators: which KV blocks of a pool and which state slots each request holds
(block 0 and slot 0 are the null block / slot of padded rows, never lent).

Blocks are reference-counted: the n samples of one prompt hold its prompt's blocks together
(`share`), each `free` drops one reference and a block returns to the free list with its
last. A block held more than once is read-only: kv_pools.KVPools copies it before a holder
writes into it (copy-on-write). State slots are never shared (a recurrent state is written in
place every step): a sample starts from a copy of its prompt's.

With prefix caching (a `prefix_cache.BlockCache`), a block with a key whose last reference is
dropped stays cached: off the plain free list, on the cache's LRU, still counted free;
`allocate` takes plain free blocks first, then evicts the least recently freed cached ones,
and `share` of a cached block (refcount 0) revives it.
"""

from mtpkit.engine.prefix_cache import BlockCache
from mtpkit.errors import ConfigError


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks-1 (0 is the null block), with a reference count
    per block (0: free)."""

    def __init__(self, num_blocks: int, cache: BlockCache | None = None):
        if num_blocks < 2:
            raise ConfigError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks, self.cache = num_blocks, cache
        self._free = list(range(num_blocks - 1, 0, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Plain free blocks and cached ones (free memory that still remembers)."""
        return len(self._free) + (len(self.cache.lru) if self.cache else 0)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) when fewer are free: plain free ones first, then
        the least recently freed cached ones (their keys dropped)."""
        if n > self.num_free:
            return None
        got = [self._free.pop() if self._free else self.cache.evict() for _ in range(n)]
        for b in got:
            self._refs[b] = 1
        return got

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (held already, or cached: a prefix hit)."""
        for b in blocks:
            assert b, "the null block is never shared"
            if not self._refs[b]:
                assert self.cache is not None and b in self.cache.lru, \
                    f"block {b} is neither held nor cached: only those are shared"
                self.cache.revive(b)
            self._refs[b] += 1

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; those left with none are free again (a
        keyed one cached: the table's last blocks first on the LRU, so a prefix outlives its
        tails)."""
        assert 0 not in blocks, "the null block is never owned"
        released = []
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} freed more often than it was held"
            self._refs[b] -= 1
            if not self._refs[b]:
                released.append(b)
        if self.cache is not None:
            released = [b for b in reversed(released) if not self.cache.park(b)][::-1]
        self._free.extend(reversed(released))

    def forget_cached(self) -> None:
        """Drop every key: the cached free blocks become plain free ones."""
        if self.cache is not None:
            self._free.extend(self.cache.clear())


class SlotAllocator:
    """State slots, handed out `per_request` at a time (slot 0 is the null slot). `num_slots`
    None: the model keeps no state, every request gets the null slots and the pool never runs
    out."""

    def __init__(self, num_slots: int | None, per_request: int):
        self.num_slots, self.per_request = num_slots, per_request
        self.stateless = num_slots is None
        if self.stateless:
            self.capacity = None
            return
        self.capacity = (num_slots - 1) // per_request  # requests the pool can hold at once
        if self.capacity < 1:
            raise ConfigError(f"num_slots={num_slots} holds no request: each needs {per_request} "
                              "slots plus the null slot")
        self._free = [list(range(1 + i * per_request, 1 + (i + 1) * per_request))
                      for i in range(self.capacity - 1, -1, -1)]

    @property
    def num_free(self) -> int | None:
        """Requests' worth of free slots (None without state)."""
        return None if self.stateless else len(self._free)

    def allocate(self) -> list[int] | None:
        if self.stateless:
            return [0] * self.per_request
        return self._free.pop() if self._free else None

    def free(self, slots: list[int]) -> None:
        if not self.stateless:
            self._free.append(list(slots))
