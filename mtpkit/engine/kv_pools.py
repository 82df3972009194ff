"""The KV block pools and each request's block tables in them.

A cache spec's KV groups live in pools by window (`cache_spec.KVPool`): "full" for full
attention, "sliding_W" for the groups of window W. A request holds one `BlockTable` per pool:
logical block b (positions b*block_size ...) -> a block id of that pool. A full pool's table
grows with the request. A sliding pool's table returns to its pool every block that no reader
can need any more, as the request advances: a step whose first query is at position s reads
keys >= s - W + 1 (each query p sees p-W+1 .. p), and a drafter that reads the target's KV
declares `kv_read_back` positions more before its query's window (the Gemma 4 assistant: 2, its
round at p reading p-W-1 ..; as p > s, that keeps one key more than it needs), so the blocks
wholly below s - W + 1 - kv_read_back are freed, and
their entries become the null block 0. Nothing below that position is ever read: the
attention kernels start at the window, and the torch gathers clamp positions below it to the
first one the window needs (paged.context_slots). A sliding pool's demand per request is
then bounded by its window, the step's own tokens and the read-back, whatever the context.
"""

import dataclasses

from mtpkit.engine.allocators import BlockAllocator
from mtpkit.step.cache_spec import KVPool


@dataclasses.dataclass
class BlockTable:
    """One request's blocks in one pool: ids[b] holds positions b*block_size ..; entries below
    `floor` were returned (0, the null block)."""

    ids: list[int] = dataclasses.field(default_factory=list)
    floor: int = 0

    def held(self) -> list[int]:
        return [b for b in self.ids[self.floor:] if b]


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def window_demand(window: int, read_back: int, tokens: int, block_size: int) -> int:
    """Blocks a sliding pool lends one request for a step of `tokens` query positions: the
    window before its first query, the read-back, the tokens; one more when they straddle a
    block boundary."""
    return blocks_for(window - 1 + read_back + tokens, block_size) + 1


class KVPools:
    """Every pool's allocator, and the rules for a request's tables in them."""

    def __init__(self, pools: tuple[KVPool, ...], num_blocks: dict[str, int], *, block_size: int,
                 max_positions: int, read_back: int, recycle: bool = True):
        """`recycle` False: sliding pools keep every block like the full pool (comparisons,
        memory measurements)."""
        self.pools = pools
        self.allocators = {p.name: BlockAllocator(num_blocks[p.name]) for p in pools}
        self.block_size, self.max_positions, self.read_back = block_size, max_positions, read_back
        self.recycle = recycle

    def __getitem__(self, name: str) -> BlockAllocator:
        return self.allocators[name]

    def __iter__(self):
        return iter(self.allocators.items())

    def new_tables(self) -> list[BlockTable]:
        return [BlockTable() for _ in self.pools]

    def keep_from(self, pool: KVPool, first_query: int) -> int:
        """The first position any reader of a step whose first query is at `first_query` (or
        of a later step) may read in this pool."""
        if pool.sliding_window is None or not self.recycle:
            return 0
        return max(0, first_query - pool.sliding_window + 1 - self.read_back)

    def ensure(self, tables: list[BlockTable], first_query: int, end: int) -> bool:
        """Blocks in every pool for positions keep_from(first_query) .. end - 1, returning
        those a sliding pool no longer needs first. False when a pool has too few free (what
        was allocated stays with the tables: the caller preempts and tries again)."""
        ok = True
        end = min(end, self.max_positions)
        for pool, t in zip(self.pools, tables):
            alloc = self.allocators[pool.name]
            lo = self.keep_from(pool, first_query) // self.block_size
            if lo > t.floor:
                freed = [b for b in t.ids[t.floor:lo] if b]
                t.ids[t.floor:lo] = [0] * (min(lo, len(t.ids)) - t.floor)
                t.floor = lo
                if freed:
                    alloc.free(freed)
            need = blocks_for(end, self.block_size)
            if need <= len(t.ids):
                continue
            gap = max(0, min(lo, need) - len(t.ids))        # entries below the window: never held
            got = alloc.allocate(need - len(t.ids) - gap)
            if got is None:
                ok = False
                continue
            t.ids.extend([0] * gap + got)
        return ok

    def release(self, tables: list[BlockTable]) -> None:
        for pool, t in zip(self.pools, tables):
            held = t.held()
            if held:
                self.allocators[pool.name].free(held)

    def demand(self, pool: KVPool, positions: int, chunk: int) -> int:
        """Blocks of `pool` a request of `positions` positions holds at most while its steps
        feed up to `chunk` tokens each."""
        full = blocks_for(min(positions, self.max_positions), self.block_size)
        if pool.sliding_window is None or not self.recycle:
            return full
        return min(full, window_demand(pool.sliding_window, self.read_back, chunk, self.block_size))

    def can_hold(self, positions: int, chunk: int) -> bool:
        """Every pool has the blocks a new request needs at its peak, free now."""
        return all(self.allocators[p.name].num_free >= self.demand(p, positions, chunk) for p in self.pools)

    @property
    def num_free(self) -> dict[str, int]:
        return {name: a.num_free for name, a in self.allocators.items()}

    @property
    def capacity(self) -> dict[str, int]:
        """Blocks each pool can lend (all but the null block)."""
        return {name: a.num_blocks - 1 for name, a in self.allocators.items()}
