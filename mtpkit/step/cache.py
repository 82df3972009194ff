"""Cache storage and its allocators, as a model's `CacheSpec` declares them (cache_spec.py).

- Paged KV, one K and one V tensor [num_blocks, block_size, kv_heads, head_dim] per layer of
  every KV group, num_blocks being its pool's (groups live in pools by window:
  cache_spec.KVPool; engine/kv_pools.py lends their blocks). Block 0 of every pool is the null
  block: padded rows read and write it, no request ever owns it.
- State slots, one tensor [num_slots, *shape] per layer and state name of every state group.
  Slot 0 is the null slot. A request owns `bundle` slots (the speculative state contract of
  docs/design.md). A model without state groups has no slot pool: its requests hold no slots.

`CacheCopies` is what a step copies before it runs: KV blocks (the copy-on-write of a block
shared by the samples of one prompt), state slots (a sample's start from its prompt's
recurrent state), and prefix-cache state snapshots (`CacheTensors.snapshots`, one entry per
snapshot of every state tensor): saves of a request's state after a block boundary, then
restores into a request that starts from a hit; `CacheTensors.apply` does it on the device.
"""

import dataclasses

import torch

from mtpkit.shapes import Float, Tensor
from mtpkit.step.cache_spec import CacheSpec


@dataclasses.dataclass
class CacheCopies:
    """Copies within the caches, done in order before a step: `blocks` (pool index, source
    block, destination block) in every KV group of that pool; `slots` (source slot,
    destination slot) in every state tensor."""

    blocks: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    slots: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    saves: list["StateSave"] = dataclasses.field(default_factory=list)
    # (snapshot entry, the request's bundle slots): after the saves (a restore may read a
    # snapshot saved in the same round, or write slots a save reads)
    restores: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.blocks or self.slots or self.saves or self.restores)


@dataclasses.dataclass(frozen=True)
class StateSave:
    """Save a request's recurrent state into snapshot `entry`: the state after its prefill
    chunk (`token` None) or after bundle token `token` of its verify step (StateTensor's
    prefill_slot / window say where that is); stored as a prefill leaves it."""

    slots: tuple[int, ...]
    token: int | None
    entry: int


def _copy_rows(t: Tensor, pairs: list[tuple[int, int]]) -> None:
    """t[dst] = t[src] for each pair, in order: one indexed copy when no destination repeats
    or is read by another pair, else one by one."""
    src, dst = [a for a, _ in pairs], [b for _, b in pairs]
    if len(set(dst)) == len(dst) and not set(dst) & set(src):
        index = torch.tensor(dst, device=t.device)
        t.index_copy_(0, index, t.index_select(0, torch.tensor(src, device=t.device)))
        return
    for a, b in pairs:
        t[b] = t[a]


@dataclasses.dataclass
class CacheTensors:
    """The storage the kernels read and write (through `Ops`); the model never owns a cache.
    kv[group][layer] = (K, V); state[group][layer][name] = that state's slots;
    pool_index[group] = the index of the group's pool in a step's stacked block tables
    (metadata `block_tables[pool]`, `slot_mappings[pool]`)."""

    kv: dict[str, list[tuple[Float[Tensor, "num_blocks block_size kv_heads head_dim"],
                             Float[Tensor, "num_blocks block_size kv_heads head_dim"]]]]
    state: dict[str, list[dict[str, Tensor]]]
    block_size: int
    pool_index: dict[str, int] = dataclasses.field(default_factory=dict)
    pool_windows: tuple[int | None, ...] = ()   # each pool's sliding window (None: full attention)
    # Prefix-cache state snapshots, like `state` with entries for slots; and each state's
    # declaration (where a snapshot copies it from)
    snapshots: dict[str, list[dict[str, Tensor]]] = dataclasses.field(default_factory=dict)
    state_specs: dict[str, dict] = dataclasses.field(default_factory=dict)

    def num_blocks(self, group: str) -> int:
        return self.kv[group][0][0].shape[0]

    @property
    def num_slots(self) -> int:
        return next((next(iter(layers[0].values())).shape[0] for layers in self.state.values() if layers), 0)

    def apply(self, copies: CacheCopies) -> None:
        """Do `copies` (see CacheCopies) on the device."""
        for k in sorted({k for k, _, _ in copies.blocks}):
            pairs = [(a, b) for j, a, b in copies.blocks if j == k]
            for g, layers in self.kv.items():
                if self.pool_index.get(g) == k:
                    for kv in layers:
                        for t in kv:
                            _copy_rows(t, pairs)
        # Per state tensor: snapshot saves first (they read slots a request may have just
        # left), then the forked samples' slots, then restores (which may read a save's entry).
        for g, layers in self.state.items() if copies.slots or copies.saves or copies.restores else ():
            for i, layer in enumerate(layers):
                for name, t in layer.items():
                    spec = self.state_specs[g][name]
                    snap = self.snapshots[g][i][name] if self.snapshots else None
                    for save in copies.saves:
                        if spec.window is None:
                            snap[save.entry] = t[save.slots[spec.prefill_slot if save.token is None else save.token]]
                        else:   # the window after the token, where a prefill reads it
                            start = t.shape[-1] - spec.window if save.token is None else save.token
                            snap[save.entry, ..., -spec.window:] = \
                                t[save.slots[spec.prefill_slot], ..., start:start + spec.window]
                    if copies.slots:
                        _copy_rows(t, copies.slots)
                    for entry, slots in copies.restores:
                        t[slots[spec.prefill_slot]] = snap[entry]

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor, in a fixed order (a captured graph's cache arguments)."""
        kv = tuple(t for layers in self.kv.values() for kv in layers for t in kv)
        return kv + tuple(layer[n] for layers in self.state.values() for layer in layers for n in sorted(layer))

    def with_tensors(self, flat) -> "CacheTensors":
        """The same structure over `flat` (as `tensors()` orders them): a traced graph's
        cache arguments seen as a cache again."""
        it = iter(flat)
        kv = {g: [(next(it), next(it)) for _ in layers] for g, layers in self.kv.items()}
        state = {g: [{n: next(it) for n in sorted(layer)} for layer in layers] for g, layers in self.state.items()}
        return CacheTensors(kv, state, self.block_size, self.pool_index, self.pool_windows, self.snapshots,
                            self.state_specs)

    def sub(self, prefix: str) -> "CacheTensors":
        """The groups named `prefix...`, under their names without it: what a drafter that
        declared its groups under a prefix reads."""
        def strip(groups):
            return {g[len(prefix):]: v for g, v in groups.items() if g.startswith(prefix)}
        return CacheTensors(strip(self.kv), strip(self.state), self.block_size, strip(self.pool_index),
                            self.pool_windows)


def allocate_cache(spec: CacheSpec, *, num_blocks: int | dict[str, int], num_slots: int, block_size: int,
                   dtype: torch.dtype, device: torch.device, num_snapshots: int = 0) -> CacheTensors:
    """Zeroed storage for every declared group (zeros keep the null block / slot finite).
    `num_blocks`: per pool name (an int: the same for every pool). `num_snapshots`: entries of
    the prefix cache's state snapshot pool."""
    def zeros(shape, dt=dtype):
        return torch.zeros(shape, dtype=dt, device=device)

    pools = spec.pools
    sizes = num_blocks if isinstance(num_blocks, dict) else {p.name: num_blocks for p in pools}
    index = {g.name: i for i, p in enumerate(pools) for g in p.groups}
    kv = {g.name: [(zeros((sizes[g.pool], block_size, g.kv_heads, g.head_dim)),
                    zeros((sizes[g.pool], block_size, g.kv_heads, g.head_dim))) for _ in range(g.num_layers)]
          for g in spec.kv}
    state = {g.name: [{n: zeros((num_slots,) + t.shape, t.dtype(dtype)) for n, t in g.tensors.items()}
                      for _ in range(g.num_layers)]
             for g in spec.state}
    snapshots = {g.name: [{n: zeros((num_snapshots,) + t.shape, t.dtype(dtype)) for n, t in g.tensors.items()}
                          for _ in range(g.num_layers)]
                 for g in spec.state} if num_snapshots else {}
    return CacheTensors(kv, state, block_size, index, tuple(p.sliding_window for p in pools), snapshots,
                        {g.name: dict(g.tensors) for g in spec.state})
