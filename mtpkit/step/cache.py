"""Cache storage and its allocators, as a model's `CacheSpec` declares them (cache_spec.py).

- Paged KV, one K and one V tensor [num_blocks, block_size, kv_heads, head_dim] per layer of
  every KV group, num_blocks being its pool's (groups live in pools by window:
  cache_spec.KVPool; engine/kv_pools.py lends their blocks). Block 0 of every pool is the null
  block: padded rows read and write it, no request ever owns it.
- State slots, one tensor [num_slots, *shape] per layer and state name of every state group.
  Slot 0 is the null slot. A request owns `bundle` slots (the speculative state contract of
  docs/design.md). A model without state groups has no slot pool: its requests hold no slots.

- State snapshots (optional), the same tensors over `snapshot_slots` rows (one per snapshot
  id, [snapshot_slots, *shape] per layer and state name): the recurrent state of a request
  at some position, kept for a later request to resume from (the prefix cache). A prefill
  step writes them in its kernels (metadata.StateSnapshots); `save_snapshots` /
  `restore_snapshots` / `save_verify_snapshots` copy between slots and snapshots. A
  snapshot's bytes are one slot's (`CacheSpec.bytes_per_slot`); docs/design.md, "State
  snapshots".

`CacheCopies` is what a step copies before it runs: KV blocks (the copy-on-write of a block
shared by the samples of one prompt), state slots (a sample's start from its prompt's
recurrent state), and prefix-cache state snapshots (`CacheTensors.snapshots`, one entry per
snapshot of every state tensor): saves of a request's state after a block boundary, then
restores into a request that starts from a hit; `CacheTensors.apply` does it on the device.
"""

import dataclasses
from collections.abc import Sequence

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


# t stays plain Tensor: any pool tensor whose first dim is its rows (KV blocks, state slots or
# snapshot stores, each of its own shape), so no one shape name fits them.
def _copy_rows(t: Tensor, pairs: list[tuple[int, int]]) -> None:
    """t[dst] = t[src] for each pair, in order: one indexed copy when no destination repeats or
    is read by another pair, else one by one."""
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
    # snapshots[group][layer][name]: [snapshot_slots, *shape], as `state` (empty: no store).
    # Not among `tensors()`: no captured step reads or writes them.
    snapshots: dict[str, list[dict[str, Tensor]]] = dataclasses.field(default_factory=dict)
    # save_verify_snapshots' views of the state and snapshot tensors, made when first used
    _views: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def num_blocks(self, group: str) -> int:
        return self.kv[group][0][0].shape[0]

    @property
    def num_slots(self) -> int:
        return next((next(iter(layers[0].values())).shape[0] for layers in self.state.values() if layers), 0)

    @property
    def num_snapshots(self) -> int:
        """Rows of the snapshot store (0: none allocated)."""
        return next((next(iter(layers[0].values())).shape[0] for layers in self.snapshots.values() if layers), 0)

    @property
    def bytes_per_snapshot(self) -> int:
        """One snapshot's bytes, every state group's layers (== CacheSpec.bytes_per_slot)."""
        return sum(t[0].numel() * t.element_size() for layers in self.state.values()
                   for layer in layers for t in layer.values())

    def _check_snapshots(self, slots: Sequence[Sequence[int]], ids: Sequence[int]) -> None:
        if len(slots) != len(ids):
            raise ValueError(f"snapshots: one id per request's slots, got {len(ids)} ids for {len(slots)}")
        missing = [g for g, layers in self.state.items() if layers and g not in self.snapshots]
        if missing:
            raise ValueError(f"no snapshot store for the state groups {missing}: allocate it for the engine's "
                             "whole CacheSpec (allocate_cache(..., num_snapshots=N) / allocate_snapshots)")

    def _slot_pairs(self, slots: Sequence[Sequence[int]], ids: Sequence[int]):
        """Per state name, the slot of each request that holds it: a request keeps its conv
        window in its first slot and its recurrent state in its last (a prefill writes them
        there; docs/design.md, "GDN state under speculation"). Other names: the first."""
        self._check_snapshots(slots, ids)
        first = torch.tensor([s[0] for s in slots], dtype=torch.int64)
        last = torch.tensor([s[-1] for s in slots], dtype=torch.int64)
        return {"ssm": last}, first, torch.tensor(list(ids), dtype=torch.int64)

    def save_snapshots(self, slots: Sequence[Sequence[int]], ids: Sequence[int]) -> None:
        """snapshot ids[i] = the state of the request holding slots[i] (its bundle state
        slots) as a prefill left it: one indexed copy per tensor."""
        by_name, first, ids_t = self._slot_pairs(slots, ids)
        for g, layers in self.state.items():
            for layer, snap in zip(layers, self.snapshots[g]):
                for n, t in layer.items():
                    src = by_name.get(n, first).to(t.device)
                    snap[n].index_copy_(0, ids_t.to(t.device), t.index_select(0, src).to(snap[n].dtype))

    def restore_snapshots(self, ids: Sequence[int], slots: Sequence[Sequence[int]]) -> None:
        """The request holding slots[i] resumes from snapshot ids[i]: as if a prefill up to the
        snapshot's position had run in its slots (its next prefill chunk reads them with
        has_initial_state). One indexed copy per tensor."""
        by_name, first, ids_t = self._slot_pairs(slots, ids)
        for g, layers in self.state.items():
            for layer, snap in zip(layers, self.snapshots[g]):
                for n, t in layer.items():
                    dst = by_name.get(n, first).to(t.device)
                    t.index_copy_(0, dst, snap[n].index_select(0, ids_t.to(t.device)).to(t.dtype))

    def save_verify_snapshots(self, slots: Sequence[Sequence[int]], positions: Sequence[int],
                              ids: Sequence[int]) -> None:
        """After a verify step, snapshot ids[i] = the state of the request holding slots[i]
        after its bundle position positions[i] (< the tokens it accepted: a rejected draft's
        state is never saved), before the next step overwrites its slots. The recurrent state
        after position t is in slot t (the GDN contract); the conv window after it starts at
        column t of the first slot and is moved to where a prefill leaves it (the last W-1
        columns), the columns before it zero (nothing reads them)."""
        self._check_snapshots(slots, ids)
        # One request at a time, with its ints on the host: a copy per tensor between views made
        # once per (snapshot, shift) and (slot, shift) (a save happens once per block of a
        # request's tokens; making its ~20 views anew each time, after a graph with the caches
        # cold, was most of its cost; the batched indexed form cost ~40 small ops whatever the count).
        for sl, t_pos, sid in zip(slots, positions, ids):
            shift = len(sl) - 1 - t_pos    # snapshot column j = slot column j - shift
            for (dst, pad), src in zip(self._snapshot_views(sid, shift), self._slot_views(sl[t_pos], sl[0], shift)):
                dst.copy_(src)
                if pad is not None:
                    pad.zero_()

    def _snapshot_views(self, sid: int, shift: int) -> list:
        """Per state tensor, in `state`'s order: (where in snapshot `sid` a save writes, the conv
        columns before the window it zeroes or None)."""
        key = ("snapshot", sid, shift)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = []
            for g, layers in self.state.items():
                for layer, snap in zip(layers, self.snapshots[g]):
                    for n in layer:
                        dst = snap[n][sid]
                        views.append((dst, None) if n != "conv" else (dst[..., shift:], dst[..., :shift] if shift else None))
        return views

    def _slot_views(self, state_slot: int, conv_slot: int, shift: int) -> list:
        """Per state tensor, in `state`'s order: what a save reads. The recurrent state after bundle
        position t is slot t's; a slot's conv columns are W-1+num_spec long and its bundle
        num_spec+1: the window after position t starts at column t of the first slot."""
        key = ("slot", state_slot, conv_slot, shift)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [t[state_slot] if n != "conv" else t[conv_slot][..., :t.shape[-1] - shift]
                                        for layers in self.state.values() for layer in layers for n, t in layer.items()]
        return views

    def apply(self, copies: CacheCopies) -> None:
        """Do `copies` (see CacheCopies) on the device."""
        for k in sorted({k for k, _, _ in copies.blocks}):
            pairs = [(a, b) for j, a, b in copies.blocks if j == k]
            for g, layers in self.kv.items():
                if self.pool_index.get(g) == k:
                    for kv in layers:
                        for t in kv:
                            _copy_rows(t, pairs)
        # Snapshot saves first (they read slots a request may have just left), then the
        # forked samples' slots, then restores (which may read a save's entry).
        prefill = [sv for sv in copies.saves if sv.token is None]
        verify = [sv for sv in copies.saves if sv.token is not None]
        if prefill:
            self.save_snapshots([sv.slots for sv in prefill], [sv.entry for sv in prefill])
        if verify:
            self.save_verify_snapshots([sv.slots for sv in verify], [sv.token for sv in verify],
                                       [sv.entry for sv in verify])
        if copies.slots:
            for layers in self.state.values():
                for layer in layers:
                    for t in layer.values():
                        _copy_rows(t, copies.slots)
        if copies.restores:
            self.restore_snapshots([e for e, _ in copies.restores], [sl for _, sl in copies.restores])

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor, in a fixed order (a captured graph's cache arguments)."""
        kv = tuple(t for layers in self.kv.values() for kv in layers for t in kv)
        return kv + tuple(layer[n] for layers in self.state.values() for layer in layers for n in sorted(layer))

    def snapshot_tensors(self) -> tuple[Tensor, ...]:
        """The snapshot store's tensors in a fixed order (the cache arguments of a captured graph
        that writes snapshots, after `tensors()`)."""
        return tuple(layer[n] for layers in self.snapshots.values() for layer in layers for n in sorted(layer))

    def with_tensors(self, flat, with_snapshots: bool = False) -> "CacheTensors":
        """The same structure over `flat` (as `tensors()` orders them, then `snapshot_tensors()`
        when `with_snapshots`): a traced graph's cache arguments seen as a cache again."""
        it = iter(flat)
        kv = {g: [(next(it), next(it)) for _ in layers] for g, layers in self.kv.items()}
        state = {g: [{n: next(it) for n in sorted(layer)} for layer in layers] for g, layers in self.state.items()}
        snapshots = self.snapshots if not with_snapshots else {
            g: [{n: next(it) for n in sorted(layer)} for layer in layers] for g, layers in self.snapshots.items()}
        return CacheTensors(kv, state, self.block_size, self.pool_index, self.pool_windows, snapshots)

    def sub(self, prefix: str) -> "CacheTensors":
        """The groups named `prefix...`, under their names without it: what a drafter that
        declared its groups under a prefix reads."""
        def strip(groups):
            return {g[len(prefix):]: v for g, v in groups.items() if g.startswith(prefix)}
        return CacheTensors(strip(self.kv), strip(self.state), self.block_size, strip(self.pool_index),
                            self.pool_windows, strip(self.snapshots))


def allocate_snapshots(spec: CacheSpec, num_snapshots: int, dtype: torch.dtype,
                       device: torch.device) -> dict[str, list[dict[str, Tensor]]]:
    """A zeroed snapshot store of `num_snapshots` rows (ids 0..num_snapshots-1), laid out as
    the state slots (CacheTensors.snapshots); spec.bytes_per_slot(dtype) bytes per row."""
    return {g.name: [{n: torch.zeros((num_snapshots,) + t.shape, dtype=t.dtype(dtype), device=device)
                      for n, t in g.tensors.items()} for _ in range(g.num_layers)]
            for g in spec.state} if num_snapshots else {}


def allocate_cache(spec: CacheSpec, *, num_blocks: int | dict[str, int], num_slots: int, block_size: int,
                   dtype: torch.dtype, device: torch.device, num_snapshots: int = 0) -> CacheTensors:
    """Zeroed storage for every declared group (zeros keep the null block / slot finite).
    `num_blocks`: per pool name (an int: the same for every pool); `num_snapshots`: rows of
    the state-snapshot store (0: none)."""
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
    return CacheTensors(kv, state, block_size, index, tuple(p.sliding_window for p in pools),
                        allocate_snapshots(spec, num_snapshots, dtype, device))
