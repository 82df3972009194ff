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

Sharing (the n samples of one prompt): `fork` gives a table the same blocks, one reference
more each (allocators.BlockAllocator counts them). A block with more than one holder is
read-only: `ensure`, which every step's writes go through, replaces each shared block the
step will write into by a private copy (copy-on-write) and returns what to copy, which the
runner does on the device before the step runs. Freeing (release, a sliding pool's blocks
below the window) drops one reference, so a shared block returns to its pool with its last
holder.

Prefix caching (engine/prefix_cache.py): `key` gives a request's full, accepted blocks their
keys in every pool (kept cached when freed); `adopt` makes tables of a hit's cached blocks
(shared, so read-only: the request writes only past the hit).
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
                 max_positions: int, read_back: int, recycle: bool = True, caches: dict | None = None):
        """`recycle` False: sliding pools keep every block like the full pool (comparisons,
        memory measurements). `caches`: each pool's prefix_cache.BlockCache (prefix caching)."""
        self.pools = pools
        self.allocators = {p.name: BlockAllocator(num_blocks[p.name], (caches or {}).get(p.name)) for p in pools}
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

    def fork(self, tables: list[BlockTable]) -> list[BlockTable]:
        """New tables holding the same blocks (one reference more each): read-only to both
        until one writes (ensure copies the block it writes into first)."""
        forked = []
        for pool, t in zip(self.pools, tables):
            self.allocators[pool.name].share(t.held())
            forked.append(BlockTable(list(t.ids), t.floor))
        return forked

    def adopt(self, entries: list[list[int]]) -> list[BlockTable]:
        """Tables over a prefix hit's blocks (each pool's entries; 0 below a sliding pool's
        window, which becomes the table's floor), one reference more each."""
        tables = []
        for pool, ids in zip(self.pools, entries):
            floor = next((i for i, b in enumerate(ids) if b), len(ids))
            self.allocators[pool.name].share(ids[floor:])
            tables.append(BlockTable(list(ids), floor))
        return tables

    def key(self, tables: list[BlockTable], keys: list[bytes], lo: int, hi: int) -> None:
        """Give blocks lo..hi-1 of every table (held, full of accepted tokens) their keys."""
        for pool, t in zip(self.pools, tables):
            cache = self.allocators[pool.name].cache
            for i in range(max(lo, t.floor), min(hi, len(t.ids))):
                if t.ids[i]:
                    cache.register(t.ids[i], keys[i])

    def shared(self, tables: list[BlockTable]) -> int:
        """How many of these tables' held blocks have another holder too."""
        return sum(self.allocators[p.name].refcount(b) > 1 for p, t in zip(self.pools, tables) for b in t.held())

    def ensure(self, tables: list[BlockTable], first_query: int, end: int,
               copies: list[tuple[int, int, int]] | None = None) -> bool:
        """Blocks in every pool for positions keep_from(first_query) .. end - 1, returning
        those a sliding pool no longer needs first, and private blocks for the positions
        first_query .. end - 1 the step writes: a shared block there is replaced by a new one,
        and (pool index, shared block, new block) appended to `copies` (the caller copies
        before the step runs; a caller that writes nothing passes none). False when a pool
        has too few free (what was allocated stays with the tables, no block was copied: the
        caller preempts and tries again)."""
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
        if ok and copies is not None:
            ok = self._copy_on_write(tables, first_query, end, copies)
        return ok

    def can_extend(self, extents: list[tuple[list[BlockTable], int, int]]) -> bool:
        """Whether `ensure(tables, first_query, end)` of every (tables, first_query, end) in
        `extents` would all succeed from the blocks free now, taking nothing: tables already
        ensured for a step from first_query on (its window's blocks returned, the blocks it
        writes private), extended to `end` by new blocks only (positions past the sequence are
        never shared)."""
        need = dict.fromkeys(self.allocators, 0)
        for tables, first_query, end in extents:
            end = min(end, self.max_positions)
            for pool, t in zip(self.pools, tables):
                lo = self.keep_from(pool, first_query) // self.block_size
                want = blocks_for(end, self.block_size)
                if want > len(t.ids):
                    need[pool.name] += want - len(t.ids) - max(0, min(lo, want) - len(t.ids))
        return all(self.allocators[name].num_free >= n for name, n in need.items())

    def _copy_on_write(self, tables: list[BlockTable], first_query: int, end: int,
                       copies: list[tuple[int, int, int]]) -> bool:
        """Private copies of the shared blocks holding positions first_query .. end - 1: all
        of them, or (too few free) none."""
        lo, hi = first_query // self.block_size, blocks_for(end, self.block_size)
        todo = [(k, b) for k, (pool, t) in enumerate(zip(self.pools, tables))
                for b in range(lo, min(hi, len(t.ids))) if t.ids[b] and self.allocators[pool.name].refcount(t.ids[b]) > 1]
        for k, pool in enumerate(self.pools):
            if sum(1 for j, _ in todo if j == k) > self.allocators[pool.name].num_free:
                return False
        for k, b in todo:
            alloc, t = self.allocators[self.pools[k].name], tables[k]
            src, (dst,) = t.ids[b], alloc.allocate(1)
            t.ids[b] = dst
            alloc.free([src])     # one holder fewer; the others keep reading it
            copies.append((k, src, dst))
        return True

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

    def can_hold(self, positions: int, chunk: int, tables: list[BlockTable] | None = None) -> bool:
        """Every pool has the blocks a new request needs at its peak, free now (beyond those
        its `tables` hold already: a prefix hit's)."""
        held = [len(t.held()) for t in tables] if tables else [0] * len(self.pools)
        return all(self.allocators[p.name].num_free >= self.demand(p, positions, chunk) - h
                   for p, h in zip(self.pools, held))

    def forget_cached(self) -> None:
        for a in self.allocators.values():
            a.forget_cached()

    @property
    def num_free(self) -> dict[str, int]:
        return {name: a.num_free for name, a in self.allocators.items()}

    @property
    def capacity(self) -> dict[str, int]:
        """Blocks each pool can lend (all but the null block)."""
        return {name: a.num_blocks - 1 for name, a in self.allocators.items()}
