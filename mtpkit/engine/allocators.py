"""Block and slot allocators: which KV blocks of a pool and which state slots each request holds
(block 0 and slot 0 are the null block / slot of padded rows, never lent).
"""

from mtpkit.errors import ConfigError


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks-1 (0 is the null block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ConfigError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        assert 0 not in blocks, "the null block is never owned"
        self._free.extend(reversed(blocks))


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
