"""What a model (or a drafter) needs from the engine's caches, declared once.

A model family declares its cache groups from its config alone (before any weight is read):

- `KVGroup`: layers with paged attention K/V of one geometry (KV heads on this rank, head
  dim, optional sliding window), one [num_blocks, block_size, kv_heads, head_dim] K and V
  tensor per layer that owns its KV. Layers that read another layer's KV own none and are
  not counted. Groups are served from block pools by window (`KVPool`): every full-attention
  group shares the pool "full", every group of window W the pool "sliding_W". Within a pool
  a block id means the same positions in every group, and a request has one block table
  per pool; a sliding pool holds only the blocks some query can still read (engine.kv_pools),
  so its size is bounded by the window, not by the context.
- `StateGroup`: layers with per-request recurrent state, held in a slot pool: each request
  owns `bundle` slots (the speculative state contract of docs/design.md), one tensor per layer
  and state name, [num_slots, *shape]. A model without state declares none and its requests
  hold no slots.

Everything else derives from the declaration: the allocated tensors (`engine.cache`), the
memory budgets (bytes per block, bytes per slot), which pools the scheduler allocates from,
and the graph runner's cache arguments.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class KVGroup:
    name: str
    num_layers: int            # layers that own K/V in this group
    kv_heads: int              # on this rank
    head_dim: int
    sliding_window: int | None = None

    @property
    def pool(self) -> str:
        return "full" if self.sliding_window is None else f"sliding_{self.sliding_window}"

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * block_size * self.kv_heads * self.head_dim * dtype.itemsize


@dataclasses.dataclass(frozen=True)
class KVPool:
    """The blocks of every KV group with one window (None: full attention)."""

    name: str
    sliding_window: int | None
    groups: tuple[KVGroup, ...]

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return sum(g.bytes_per_block(block_size, dtype) for g in self.groups)


@dataclasses.dataclass(frozen=True)
class StateTensor:
    shape: tuple[int, ...]     # one slot's
    fp32: bool = False         # kept in fp32 whatever the model dtype (fp64 when it runs in fp64)

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if model_dtype == torch.float64 or not self.fp32:
            return model_dtype
        return torch.float32


@dataclasses.dataclass(frozen=True)
class StateGroup:
    name: str
    num_layers: int
    tensors: dict[str, StateTensor]

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        one = sum(t.dtype(dtype).itemsize * _numel(t.shape) for t in self.tensors.values())
        return self.num_layers * one


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    kv: tuple[KVGroup, ...] = ()
    state: tuple[StateGroup, ...] = ()

    def __post_init__(self):
        names = [g.name for g in self.kv] + [g.name for g in self.state]
        if len(set(names)) != len(names):
            raise ValueError(f"cache group names must be unique, got {names}")

    def __add__(self, other: "CacheSpec") -> "CacheSpec":
        return CacheSpec(self.kv + other.kv, self.state + other.state)

    def prefixed(self, prefix: str) -> "CacheSpec":
        """The same groups under `prefix + name` (a drafter's groups beside its target's)."""
        return CacheSpec(tuple(dataclasses.replace(g, name=prefix + g.name) for g in self.kv),
                         tuple(dataclasses.replace(g, name=prefix + g.name) for g in self.state))

    @property
    def has_state(self) -> bool:
        return any(g.num_layers for g in self.state)

    @property
    def pools(self) -> tuple[KVPool, ...]:
        """The block pools of the KV groups: the full-attention pool first, then by window."""
        windows = sorted({g.sliding_window for g in self.kv if g.num_layers}, key=lambda w: (w is not None, w or 0))
        return tuple(KVPool("full" if w is None else f"sliding_{w}", w,
                            tuple(g for g in self.kv if g.sliding_window == w and g.num_layers)) for w in windows)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        return sum(g.bytes_per_slot(dtype) for g in self.state)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
