"""Block and slot allocators: which KV blocks of a pool and which state slots each request holds
(block 0 and slot 0 are the null block / slot of padded rows, never lent).

Blocks are reference-counted: the n samples of one prompt hold its prompt's blocks together
(`share`), each `free` drops one reference and a block returns to the free list with its
last. A block held more than once is read-only: kv_pools.KVPools copies it before a holder
writes into it (copy-on-write). State slots are never shared (a recurrent state is written in
place every step): a sample starts from a copy of its prompt's.
"""

from mtpkit.errors import ConfigError


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks-1 (0 is the null block), with a reference count
    per block (0: free)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ConfigError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        got = [self._free.pop() for _ in range(n)]
        for b in got:
            self._refs[b] = 1
        return got

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (held already)."""
        for b in blocks:
            assert b and self._refs[b] > 0, f"block {b} is not held: only held blocks are shared"
            self._refs[b] += 1

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; those left with none are free again."""
        assert 0 not in blocks, "the null block is never owned"
        released = []
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} freed more often than it was held"
            self._refs[b] -= 1
            if not self._refs[b]:
                released.append(b)
        self._free.extend(reversed(released))


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
