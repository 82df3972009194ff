"""Every cache pool's size, in one place: the KV block pools (one per window) and the
recurrent-state slot pool.

A sliding-window pool is always sized from its window: every running request's window and
verify span plus the largest prefill step's tokens (kv_pool_sizes). The full-attention pool and
the state pool are sized, in this order, by a memory budget (plan_pools: what the budget leaves
after the weights and a step's activations, engine/memory_plan.py), explicit counts (num_blocks,
num_state_slots), byte amounts (kv_cache_memory, state_cache_memory), else enough for
max_num_seqs requests at max_model_len. A size that cannot hold one request is a ConfigError
saying what to give, raised before any weight is read.
"""

import dataclasses

import torch

from mtpkit.config import EngineConfig
from mtpkit.engine.kv_pools import blocks_for, window_demand
from mtpkit.engine.memory_plan import MemoryPlan, activation_estimate, gib, weight_bytes
from mtpkit.sampling.controls import ControlTables, controls_dtype
from mtpkit.errors import ConfigError
from mtpkit.step.cache_spec import CacheSpec


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    kv: dict[str, int]              # blocks of every KV pool, the null block included
    state_slots: int | None         # the null slot included; None: the model keeps no state
    snapshots: int = 0              # prefix-cache state snapshots (a state slot's bytes each)


# The snapshot pool's default: this many snapshots per max_num_seqs request (a few turns of a
# chat, or a few shared prompts, per request that can run at once).
SNAPSHOTS_PER_REQUEST = 4


def prefix_snapshots(spec: CacheSpec, ecfg: EngineConfig, *, enabled: bool, num: int | None) -> int:
    """Entries of the prefix cache's state snapshot pool: none without recurrent state or
    without prefix caching; `num` if given; else SNAPSHOTS_PER_REQUEST per max_num_seqs."""
    if not enabled or not spec.has_state:
        return 0
    return num if num is not None else SNAPSHOTS_PER_REQUEST * ecfg.max_num_seqs


def kv_pool_sizes(spec: CacheSpec, ecfg: EngineConfig, *, full_blocks: int | None,
                  recycle: bool = True) -> dict[str, int]:
    """Blocks of every pool (the null block included). The full pool: `full_blocks`. A sliding
    pool: every running request's window and verify span, plus the largest prefill step's
    tokens; never more than the full context of every request would take (without `recycle`:
    `full_blocks`, as the full pool)."""
    sizes = {}
    for pool in spec.pools:
        if pool.sliding_window is None or not recycle:
            if full_blocks is None:
                raise ValueError("the full pool's size is needed")
            sizes[pool.name] = full_blocks
            continue
        steady = ecfg.max_num_seqs * window_demand(pool.sliding_window, ecfg.kv_read_back, ecfg.decode_span,
                                                   ecfg.block_size)
        chunk = blocks_for(ecfg.max_num_batched_tokens, ecfg.block_size)
        sizes[pool.name] = 1 + min(ecfg.max_num_seqs * ecfg.max_blocks, steady + chunk)
    return sizes


def check_kv_pool_sizes(spec: CacheSpec, ecfg: EngineConfig, sizes: dict[str, int], *, recycle: bool = True) -> None:
    """Every pool holds one request at max_model_len, or a ConfigError saying what to give."""
    for pool in spec.pools:
        n = sizes[pool.name]
        if pool.sliding_window is None or not recycle:
            need = ecfg.max_blocks
        else:
            need = min(ecfg.max_blocks, window_demand(pool.sliding_window, ecfg.kv_read_back,
                                                      max(ecfg.verify_span, ecfg.max_num_batched_tokens),
                                                      ecfg.block_size))
        if n < 1 + need:
            what = "num_blocks" if pool.sliding_window is None else f"the {pool.name} pool"
            raise ConfigError(f"{what}={n} cannot hold one sequence of max_model_len={ecfg.max_model_len} (needs "
                              f"{need} blocks of {ecfg.block_size} plus the null block); give more KV memory or "
                              "lower max_model_len")


def full_pool_blocks(spec: CacheSpec, ecfg: EngineConfig, dtype: torch.dtype, *, num_blocks: int | None,
                     kv_cache_memory: int | None, recycle: bool) -> int:
    """The full-attention pool's blocks: `num_blocks`, else what kv_cache_memory leaves after
    the sliding-window pools, else every request at max_model_len (and the null block)."""
    if num_blocks is not None:
        return num_blocks
    if kv_cache_memory is None:
        return 1 + ecfg.max_num_seqs * ecfg.max_blocks
    sliding = sum(n * p.bytes_per_block(ecfg.block_size, dtype)
                  for p, n in zip(spec.pools, kv_pool_sizes(spec, ecfg, full_blocks=0, recycle=recycle).values())
                  if p.sliding_window is not None)
    full = next((p for p in spec.pools if p.sliding_window is None), None)
    per_block = full.bytes_per_block(ecfg.block_size, dtype) if full else 1
    return max((kv_cache_memory - sliding) // per_block, 0)


def state_slots(spec: CacheSpec, ecfg: EngineConfig, dtype: torch.dtype, *, num_state_slots: int | None,
                state_cache_memory: int | None) -> int | None:
    """The state pool's slots (the null slot included): `num_state_slots`, else what
    state_cache_memory holds, else `bundle` for each of max_num_seqs requests; None when the
    model keeps no state (its requests take no slots). Too few for one request: ConfigError."""
    bundle, max_num_seqs = ecfg.bundle, ecfg.max_num_seqs
    given = num_state_slots is not None
    if not spec.has_state:
        return None
    if num_state_slots is None:
        if state_cache_memory is not None:
            per_slot = spec.bytes_per_slot(dtype)
            num_state_slots = state_cache_memory // per_slot
        else:
            num_state_slots = 1 + max_num_seqs * bundle
    if num_state_slots < 1 + bundle:
        need, full = 1 + bundle, 1 + max_num_seqs * bundle
        if given or state_cache_memory is None:
            source, fix = f"num_state_slots={num_state_slots}", "num_state_slots"
        else:
            source = f"state_cache_memory={state_cache_memory} ({num_state_slots} state slots)"
            fix, need, full = "state_cache_memory", need * per_slot, full * per_slot
        raise ConfigError(f"{source}: the recurrent-state pool holds no request; each request needs "
                          f"num_spec + 1 = {bundle} state slots plus one shared null slot, so give "
                          f"{fix} >= {need} ({full} for max_num_seqs={max_num_seqs}), or leave it unset")
    return num_state_slots


def size_pools(spec: CacheSpec, ecfg: EngineConfig, dtype: torch.dtype, *, num_blocks: int | None,
               num_state_slots: int | None, kv_cache_memory: int | None, state_cache_memory: int | None,
               recycle: bool, snapshots: int = 0) -> PoolSizes:
    """Every pool's size from the counts or byte amounts given (a budget's plan gives counts)."""
    full = full_pool_blocks(spec, ecfg, dtype, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                            recycle=recycle)
    kv = kv_pool_sizes(spec, ecfg, full_blocks=full, recycle=recycle)
    check_kv_pool_sizes(spec, ecfg, kv, recycle=recycle)
    return PoolSizes(kv, state_slots(spec, ecfg, dtype, num_state_slots=num_state_slots,
                                     state_cache_memory=state_cache_memory), snapshots)


def plan_pools(*, budget: int, weight_bytes: int, activation_bytes: int, activation_source: str,
               spec: CacheSpec, block_size: int, dtype: torch.dtype, max_blocks: int, bundle: int,
               max_num_seqs: int, max_model_len: int, source: str,
               sliding_blocks: dict[str, int] | None = None, snapshots: int = 0,
               control_bytes: int = 0) -> MemoryPlan:
    """The pools' sizes from a budget; `source` names the budget in the error (e.g.
    "memory_budget=..."). `sliding_blocks`: the sliding-window pools' sizes (kv_pool_sizes),
    fixed here. `control_bytes`: the generation controls' tables (ControlTables.bytes_for)."""
    sliding_blocks = sliding_blocks or {}
    pools = {p.name: p for p in spec.pools}
    bpb = pools["full"].bytes_per_block(block_size, dtype) if "full" in pools else 0
    sliding = sum(n * pools[name].bytes_per_block(block_size, dtype) for name, n in sliding_blocks.items())
    bps = spec.bytes_per_slot(dtype) if spec.has_state else 0
    # The state pool holds every request the scheduler may run (max_num_seqs: a request owns
    # its slots while running, whatever its length), the sliding pools what their windows
    # bound; the full KV pool at least one request at max_model_len plus the null block, and
    # every byte left.
    num_slots = 1 + max_num_seqs * bundle if spec.has_state else None
    state = ((num_slots or 0) + snapshots) * bps + sliding
    kv_min = (1 + max_blocks) * bpb
    left = budget - weight_bytes - activation_bytes - control_bytes - state
    if left < kv_min:
        need = weight_bytes + activation_bytes + control_bytes + state + kv_min
        raise ConfigError(
            f"the model cannot fit in {source}: budget {gib(budget)}, but weights need {gib(weight_bytes)}, "
            f"activations {gib(activation_bytes)} ({activation_source}), "
            + (f"the generation controls' tables {gib(control_bytes)} (max_num_seqs={max_num_seqs} rows of the "
               "vocabulary), " if control_bytes else "")
            + (f"the state pool {gib((num_slots or 0) * bps)} ({num_slots} slots of {bps} B: bundle={bundle} per "
               f"request for max_num_seqs={max_num_seqs}, and the null slot), " if num_slots else "")
            + (f"the prefix cache's {snapshots} state snapshots {gib(snapshots * bps)} (num_prefix_snapshots), "
               if snapshots else "")
            + (f"the sliding-window KV pools {gib(sliding)} ({sliding_blocks} blocks), " if sliding_blocks else "")
            + f"the KV pool for one request at max_model_len={max_model_len} "
            f"{gib(kv_min)} ({1 + max_blocks} blocks of {bpb} B, the null block included): {gib(need)} in all, "
            f"{gib(need - budget)} short. Give a larger budget, or lower max_model_len, max_num_seqs or "
            "max_num_batched_tokens, or use an FP8 checkpoint or tensor parallelism")
    num_blocks = left // bpb if bpb else 2
    max_concurrent = min(max_num_seqs, (num_blocks - 1) // max_blocks) if bpb else max_num_seqs
    return MemoryPlan(budget, weight_bytes, activation_bytes, activation_source, num_blocks, num_slots,
                      bpb, bps, max_concurrent, max_model_len, sliding, dict(sliding_blocks), snapshots,
                      control_bytes)


def plan_memory(budget: tuple[int, str], spec: CacheSpec, ecfg: EngineConfig, dtype: torch.dtype, *,
                meta: list[torch.nn.Module], vocab: int, recycle: bool,
                activation_bytes: int | None = None, snapshots: int = 0) -> MemoryPlan:
    """plan_pools for `budget` (memory_plan.budget_of) with the weights of the `meta` models
    (memory_plan.meta_models) and the activations measured (`activation_bytes`, the CUDA
    profile run) or, before any weight is read, estimated."""
    source = "measured" if activation_bytes is not None else "estimated"
    if activation_bytes is None:
        activation_bytes = activation_estimate(meta[0], tokens=ecfg.max_num_batched_tokens,
                                               logits_rows=ecfg.max_num_seqs * ecfg.bundle, vocab=vocab, dtype=dtype)
    sliding = {k: n for k, n in kv_pool_sizes(spec, ecfg, full_blocks=0, recycle=recycle).items() if k != "full"}
    return plan_pools(budget=budget[0], weight_bytes=weight_bytes(meta, dtype), activation_bytes=activation_bytes,
                      activation_source=source, spec=spec, block_size=ecfg.block_size, dtype=dtype,
                      max_blocks=ecfg.max_blocks, bundle=ecfg.bundle, max_num_seqs=ecfg.max_num_seqs,
                      max_model_len=ecfg.max_model_len, source=budget[1], sliding_blocks=sliding, snapshots=snapshots,
                      control_bytes=ControlTables.bytes_for(ecfg.max_num_seqs + 1, vocab, controls_dtype(dtype)))


def pool_bytes(spec: CacheSpec, sizes: PoolSizes, block_size: int, dtype: torch.dtype) -> int:
    """Bytes allocate_cache takes for these sizes: every pool's blocks and the state slots."""
    kv = sum(sizes.kv[p.name] * p.bytes_per_block(block_size, dtype) for p in spec.pools)
    return kv + ((sizes.state_slots or 0) + sizes.snapshots) * spec.bytes_per_slot(dtype)


def available_memory(device: torch.device) -> int | None:
    """Bytes the caches could take now: free device memory on CUDA; on CPU the host's available
    memory (MemAvailable; None where the system does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pools_fit(spec: CacheSpec, ecfg: EngineConfig, sizes: PoolSizes, dtype: torch.dtype,
                    device: torch.device, available: int | None = None) -> None:
    """Before allocating: pools larger than the memory there is are a ConfigError with the
    numbers and the fix, not an allocation the kernel kills the process for."""
    need = pool_bytes(spec, sizes, ecfg.block_size, dtype)
    have = available_memory(device) if available is None else available
    if have is None or need <= have:
        return
    where = "free GPU memory" if device.type == "cuda" else "available host memory"
    raise ConfigError(
        f"the KV and state pools need {gib(need)} ({sizes.kv} KV blocks of {ecfg.block_size} tokens"
        + (f", {sizes.state_slots} state slots" if sizes.state_slots else "") + f"), more than the {gib(have)} of "
        f"{where}; lower max_num_seqs={ecfg.max_num_seqs} or max_model_len={ecfg.max_model_len} (the default "
        "pools hold max_num_seqs requests at max_model_len), or size the pools explicitly (num_blocks, "
        "kv_cache_memory, memory_budget)")
