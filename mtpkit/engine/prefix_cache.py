"""Prefix caching: a new request reuses the KV blocks (and, for a model with recurrent state,
a state snapshot) of the longest cached prefix of its tokens, at block granularity, and
prefills only the rest.

- **Block keys** (`extend_keys`): block i of a sequence (positions i*block_size ..) is keyed
  by a chained hash of (key of block i-1, its token ids), rooted in an engine-wide salt (the
  model, the drafter, the dtype: what else changes the KV). With a drafter whose KV at
  position p is computed from the token at p + 1 (the MTP head: docs/design.md, MTP contract)
  the key also holds the token after the block, so a block is keyed only once that token is
  known. hashlib, never Python's `hash()` of bytes or str (salted per process): every rank of
  a tensor-parallel group computes the same keys and makes the same decisions.
- **Blocks** (`BlockCache`, one per pool, used by allocators.BlockAllocator): a block with a
  key whose last holder frees it stays in the pool's index (key -> block) and joins the
  pool's LRU of cached free blocks instead of the plain free list; `allocate` takes plain
  free blocks first, then evicts the least recently freed cached ones (their keys dropped);
  a hit `share`s cached blocks (refcount 0 -> 1 takes them off the LRU). Only full blocks
  whose every position was written by accepted tokens are ever keyed (the scheduler keys
  blocks below num_computed, after the step that computed them).
- **Snapshots** (`SnapshotCache`): the recurrent state after a block boundary, in its own
  pool (CacheTensors.snapshots), indexed by the key of the block that ends there, LRU.
- **Stats** (`PrefixCacheStats`): queries, tokens asked and hit, evictions.
"""

import collections
import dataclasses
import hashlib
from array import array
from collections.abc import Sequence


def root_key(salt: str) -> bytes:
    """The parent of block 0: a digest of what, besides the tokens, decides the KV."""
    return hashlib.blake2b(salt.encode(), digest_size=16).digest()


def extend_keys(keys: list[bytes], tokens: Sequence[int], block_size: int, lookahead: bool, root: bytes,
                offset: int = 0) -> None:
    """Append the keys of the blocks of the sequence not keyed yet: block i once its tokens are
    known (and with `lookahead` the token after it too). `tokens`: the sequence from position
    `offset` on (at most len(keys) * block_size: the tokens of the blocks keyed already may be left out)."""
    i = len(keys)
    if offset > i * block_size:
        raise ValueError(f"tokens from position {offset} leave out block {i}, the first one not keyed yet")
    while (i + 1) * block_size + lookahead <= offset + len(tokens):
        lo = i * block_size - offset
        h = hashlib.blake2b(keys[-1] if keys else root, digest_size=16)
        h.update(array("q", tokens[lo:lo + block_size]).tobytes())
        if lookahead:
            h.update(b"next" + array("q", [tokens[lo + block_size]]).tobytes())
        keys.append(h.digest())
        i += 1


class BlockCache:
    """One pool's cached blocks: key <-> block for every keyed block (held or not), and the
    LRU of the keyed blocks no request holds (oldest first)."""

    def __init__(self):
        self.index: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0

    def lookup(self, key: bytes) -> int | None:
        return self.index.get(key)

    def register(self, block: int, key: bytes) -> bool:
        """Key a held block (False: it has a key already, or another block has this one)."""
        if block in self.key_of or key in self.index:
            return False
        self.index[key], self.key_of[block] = block, key
        return True

    def park(self, block: int) -> bool:
        """Its last holder freed `block`: kept (True) when it has a key."""
        if block not in self.key_of:
            return False
        self.lru[block] = None
        return True

    def revive(self, block: int) -> None:
        del self.lru[block]

    def evict(self) -> int:
        """The least recently freed cached block, its key dropped."""
        block, _ = self.lru.popitem(last=False)
        del self.index[self.key_of.pop(block)]
        self.evictions += 1
        return block

    def clear(self) -> list[int]:
        """Forget every key; returns the cached free blocks (plain free from now on)."""
        free = list(self.lru)
        self.index.clear(), self.key_of.clear(), self.lru.clear()
        return free


class SnapshotCache:
    """Entries 0..num-1 of the snapshot pool: key -> entry, LRU over every entry. Entries a
    restore of the coming step reads are pinned until that step is planned (never evicted
    before the copy has run)."""

    def __init__(self, num: int):
        self.num = num
        self._free = list(range(num - 1, -1, -1))
        self.index: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.pinned: set[int] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, key: bytes) -> int | None:
        return self.index.get(key)

    def use(self, entry: int) -> None:
        """A restore reads it in the coming step."""
        self.lru.move_to_end(entry)
        self.pinned.add(entry)

    def take(self, key: bytes) -> int | None:
        """An entry to save the state of `key` into (None: cached already, or every entry
        pinned / no pool)."""
        if key in self.index or not self.num:
            return None
        if self._free:
            entry = self._free.pop()
        else:
            entry = next((e for e in self.lru if e not in self.pinned), None)
            if entry is None:
                return None
            del self.lru[entry]
            del self.index[self.key_of.pop(entry)]
            self.evictions += 1
        self.index[key], self.key_of[entry] = entry, key
        self.lru[entry] = None
        self.pinned.add(entry)   # its save runs before the step: not reused for another this round
        return entry

    def drop(self, entry: int) -> None:
        """Forget one entry (a request's superseded decode snapshot)."""
        if entry in self.key_of and entry not in self.pinned:
            del self.index[self.key_of.pop(entry)]
            del self.lru[entry]
            self._free.append(entry)

    def clear(self) -> None:
        self.__init__(self.num)


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters since the engine started (reset_prefix_cache keeps them)."""

    queries: int = 0                 # requests (and recomputations) that looked the cache up
    query_tokens: int = 0            # their tokens to prefill
    hit_tokens: int = 0              # of those, tokens taken from the cache
    evictions: int = 0               # cached blocks reused for other content
    snapshot_evictions: int = 0
    cached_blocks: int = 0           # keyed blocks now (held or free)
    snapshots: int = 0               # snapshots now

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def __str__(self) -> str:
        return (f"prefix cache: hit rate {self.hit_rate:.2f} ({self.hit_tokens}/{self.query_tokens} tokens, "
                f"{self.queries} queries), {self.cached_blocks} cached blocks, {self.evictions} evictions"
                + (f", {self.snapshots} state snapshots ({self.snapshot_evictions} evicted)"
                   if self.snapshots or self.snapshot_evictions else ""))


class PrefixCache:
    """The engine's prefix cache: the keys' salt and lookahead, every pool's BlockCache (given
    to its allocator), the snapshots (stateful models), the counters and the hit lookup."""

    def __init__(self, *, salt: str, lookahead: bool, block_size: int, pool_names: Sequence[str],
                 num_snapshots: int | None, snapshot_interval: int):
        """`num_snapshots` None: the model keeps no state (a hit needs KV blocks only)."""
        self.root, self.lookahead, self.block_size = root_key(salt), lookahead, block_size
        self.blocks = {name: BlockCache() for name in pool_names}
        self.stateful = num_snapshots is not None
        self.snapshots = SnapshotCache(num_snapshots or 0)
        self.snapshot_interval = snapshot_interval
        self.counters = PrefixCacheStats()

    def keys(self, r) -> list[bytes]:
        """r's block keys, extended to its tokens now."""
        extend_keys(r.block_keys, r.all_token_ids, self.block_size, self.lookahead, self.root)
        return r.block_keys

    def match(self, keys: list[bytes], max_blocks: int, pools) -> tuple[int, list[list[int]], int | None, int]:
        """The longest hit of at most `max_blocks` blocks: (blocks k, each pool's table
        entries for positions 0 .. k*block_size - 1 (0 below a sliding pool's window), the
        snapshot entry of boundary k (stateful models), the blocks the full pools hold
        whatever the snapshots). A full pool needs every block below the boundary, a sliding
        pool those its first query there still reads (KVPools.keep_from), a stateful model a
        snapshot at the boundary too."""
        caches = [self.blocks[p.name] for p in pools.pools]
        longest = min(max_blocks, len(keys))
        for pool, c in zip(pools.pools, caches):
            if pool.sliding_window is None or not pools.recycle:
                longest = next((i for i in range(longest) if keys[i] not in c.index), longest)
        kv = longest
        for k in range(longest, 0, -1):
            snap = self.snapshots.lookup(keys[k - 1]) if self.stateful else None
            if self.stateful and snap is None:
                continue
            tables = []
            for pool, c in zip(pools.pools, caches):
                lo = pools.keep_from(pool, k * self.block_size) // self.block_size
                ids = [c.index.get(keys[i], 0) for i in range(lo, k)]
                if 0 in ids:
                    break
                tables.append([0] * lo + ids)
            else:
                return k, tables, snap, kv
        return 0, [], None, kv

    def stats(self) -> PrefixCacheStats:
        c = self.counters
        c.evictions = sum(b.evictions for b in self.blocks.values())
        c.cached_blocks = sum(len(b.index) for b in self.blocks.values())
        c.snapshots, c.snapshot_evictions = len(self.snapshots), self.snapshots.evictions
        return dataclasses.replace(c)
