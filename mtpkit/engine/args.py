"""The engine's arguments (every `LLM(...)` keyword) and their checks.

The checks here need no checkpoint; those that need its config.json (max_model_len, tensor
parallelism, the drafter) run in engine/build.py, still before any weight is read.
"""

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from mtpkit.config import MAX_NUM_SPEC
from mtpkit.sampling.params import MAX_SEED
from mtpkit.errors import ConfigError

LOAD_FORMATS = ("safetensors", "dummy")
COMPILE_MODES = ("inductor", "freeze", "aot", "aot-tuned")   # graphs/compiled.py MODES (floor 8: not imported here)


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """draft_model: a checkpoint directory (or built-in name) that drafts num_spec tokens
    per step; None uses the model family's own drafter (Qwen3-Next: its MTP head).
    tensor_parallel_size: ranks the model is split over; None means every process of
    the launched job (`accelerate launch` / torchrun), 1 when not launched. It must divide
    the launched world size: a smaller size makes world / size replicas of consecutive
    ranks (parallel.replica_ranks), each its own group that runs its own requests. Every
    rank of a group runs the engine and returns the same outputs.
    load_format "dummy": random weights from config.json alone (benchmarks, GPU checks).
    num_threads (CPU): torch's intra-op threads. None: 1 for models under 50M parameters,
    whose ops are too small to gain from threads and which slow down many times over when
    another process holds a core (threads wait on each other at every op); larger models keep
    torch's default. It is process-wide (torch.set_num_threads).
    gpu_memory_utilization (CUDA; share of the device's memory) or memory_budget (bytes, any
    device): size the KV and state pools from what is left after the weights and a step's
    activations (engine/memory_plan.py), print the plan (llm.memory_plan), and refuse a model
    that cannot fit before any weight is read.
    keep_fp8 (FP8 checkpoints): keep the FP8 weights with their block scales and run the
    block-scaled FP8 matmul (Triton on CUDA, its torch reference elsewhere); False
    dequantizes them to `dtype` at load. None: kept on CUDA, dequantized elsewhere.
    recycle_sliding_kv: a sliding-window layer group keeps only the KV blocks its window (and
    a drafter) can still read and returns the rest as a request advances (engine/kv_pools.py),
    so its memory is bounded by the window; False keeps every block for the whole context
    (comparisons and memory measurements).
    num_blocks / kv_cache_memory size the full-attention KV pool, num_state_slots /
    state_cache_memory the recurrent-state pool (engine/pool_sizing.py).
    enable_prefix_caching: a new request reuses the KV blocks (and, for a model with recurrent
    state, a state snapshot) of the longest cached prefix of its prompt, at block granularity
    (engine/prefix_cache.py). prefix_snapshot_interval (models with recurrent state): prefill
    snapshots the state every that many tokens (a multiple of block_size; None: the multiple
    nearest 512) and at the prompt's
    last full block; num_prefix_snapshots: entries of the snapshot pool (None: 4 per
    max_num_seqs request; pool_sizing.prefix_snapshots).
    compile (CPU, opt-in): the traced decode graphs are also compiled once each has served
    compile_after replays (graphs/compiled.py): "inductor" (torch.compile, default mode; seconds
    per graph warm from inductor's cache, minutes cold), "freeze" (inductor with frozen weights
    and max-autotune's C++ GEMMs: the fastest steps, minutes per graph, never cached) or "aot"
    (torch.export + AOTInductor packages cached under compile_cache_dir, default
    ~/.cache/mtpkit/aot: a warm start loads them), or "aot-tuned" (the same packages compiled with
    frozen weights and max-autotune's C++ GEMMs: minutes per graph cold, cached alike). None
    (default): TorchScript traces replay, so an engine starts in seconds. compile_after None: graphs.compiled.COMPILE_AFTER.
    draft_dtype (CPU, opt-in): the dtype the drafter's own weights and passes run in ("bfloat16"
    beside a float32 target); None or "auto": the target's dtype. What is generated does not
    change (the target verifies every draft); a pass reads half the bytes, and the drafts (so the
    acceptance) may differ a little. It pays in compiled graphs (compile="aot-tuned") on CPUs with
    bfloat16 arithmetic; the traced graphs run it slower (docs/performance.md). For the drafters
    that say so (DraftSetup.own_dtype: the MTP head, the Gemma 4 assistant), one process (no
    tensor parallelism), weights not kept in FP8.
    num_scheduler_steps (CPU graphs, num_spec=0, opt-in; vLLM's name): up to this many decode
    steps run per scheduling, a decode graph replayed that many times in a row, each replay
    writing the next one's inputs itself (graphs/captured.CapturedSteps.decode), so the
    scheduling, metadata and bookkeeping around a step are paid once for several tokens.
    Only steps whose every request is without controls, logprobs or a grammar run so, greedy or
    random (the run's graph samples each step: a seeded request draws what it draws one step at
    a time); others run one step at a time; a run stops at a request's max_tokens / max_model_len and,
    with a prefix cache over recurrent state, at its next block boundary (whose state snapshot
    it saves). What is generated does not change; a stream reports the run's tokens together,
    and a request queued meanwhile waits for the run to end. 1 (default): one step at a time.
    """

    num_spec: int = 0
    draft_model: str | Path | None = None
    max_num_seqs: int = 8
    max_model_len: int | None = None
    dtype: object = "auto"
    device: object = None
    enforce_eager: bool = False
    seed: int = 0
    block_size: int = 16
    num_blocks: int | None = None
    num_state_slots: int | None = None
    kv_cache_memory: int | None = None
    state_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    memory_budget: int | None = None
    max_num_batched_tokens: int = 2048
    graph_sizes: Sequence[int] | None = None
    cudagraph_capture_sizes: Sequence[int] | None = None
    attn_backend: str | None = None
    tensor_parallel_size: int | None = None
    load_format: str = "safetensors"
    num_threads: int | None = None
    keep_fp8: bool | None = None
    recycle_sliding_kv: bool = True
    enable_prefix_caching: bool = True
    prefix_snapshot_interval: int | None = None
    num_prefix_snapshots: int | None = None
    compile: str | None = None
    compile_after: int | None = None
    compile_cache_dir: str | Path | None = None
    draft_dtype: object = None
    num_scheduler_steps: int = 1


def check_load_format(load_format: str) -> None:
    """First of all: it decides whether weights are read at all."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format={load_format!r} must be 'safetensors' or 'dummy'")


def check_args(a: EngineArgs) -> None:
    """Types and ranges of the arguments that need no checkpoint (ConfigError)."""
    for name in ("recycle_sliding_kv", "enable_prefix_caching"):
        if not isinstance(getattr(a, name), bool):
            raise ConfigError(f"{name}={getattr(a, name)!r} must be True or False")
    for name in ("max_num_seqs", "block_size", "max_num_batched_tokens", "seed", "max_model_len", "num_blocks",
                 "num_state_slots", "kv_cache_memory", "state_cache_memory", "num_threads", "memory_budget",
                 "prefix_snapshot_interval", "num_prefix_snapshots", "num_scheduler_steps"):
        v = getattr(a, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"{name}={v!r} must be an int")
    if a.compile is not None and a.compile not in COMPILE_MODES:
        raise ConfigError(f"compile={a.compile!r} must be None or one of {', '.join(map(repr, COMPILE_MODES))}")
    if a.compile_after is not None and (not isinstance(a.compile_after, int) or isinstance(a.compile_after, bool)
                                        or a.compile_after < 0):
        raise ConfigError(f"compile_after={a.compile_after!r} must be an int >= 0 (replays before a graph is compiled)")
    if a.keep_fp8 is not None and not isinstance(a.keep_fp8, bool):
        raise ConfigError(f"keep_fp8={a.keep_fp8!r} must be True, False or None (None: keep FP8 weights on CUDA)")
    if not 0 <= a.seed <= MAX_SEED:
        raise ConfigError(f"seed={a.seed} must be in 0..2**64-1 (the range SamplingParams.seed takes)")
    if a.num_threads is not None and a.num_threads < 1:
        raise ConfigError(f"num_threads={a.num_threads} must be >= 1")
    n = a.num_spec
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_NUM_SPEC:
        raise ConfigError(f"num_spec={n!r} must be an int in 0..{MAX_NUM_SPEC}")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(a, name) < 1:
            raise ConfigError(f"{name}={getattr(a, name)} must be >= 1")
    if a.prefix_snapshot_interval is not None and (a.prefix_snapshot_interval < 1 or
                                                   a.prefix_snapshot_interval % a.block_size):
        raise ConfigError(f"prefix_snapshot_interval={a.prefix_snapshot_interval} must be a positive multiple of "
                          f"block_size={a.block_size} (snapshots sit at block boundaries)")
    if not isinstance(a.num_scheduler_steps, int) or isinstance(a.num_scheduler_steps, bool):
        raise ConfigError(f"num_scheduler_steps={a.num_scheduler_steps!r} must be an int >= 1 (decode steps per "
                          "scheduling; 1: one at a time)")
    if a.num_scheduler_steps < 1:
        raise ConfigError(f"num_scheduler_steps={a.num_scheduler_steps} must be >= 1 (decode steps per scheduling)")
    if a.num_scheduler_steps > 1 and n:
        raise ConfigError(f"num_scheduler_steps={a.num_scheduler_steps} runs several decode steps per scheduling "
                          f"without drafts; num_spec={n} already emits up to {n + 1} tokens a step: set "
                          "num_scheduler_steps=1 or num_spec=0")
    if a.num_scheduler_steps > 1 and a.enforce_eager:
        raise ConfigError(f"num_scheduler_steps={a.num_scheduler_steps} replays the captured decode graph; "
                          "enforce_eager=True has none: drop one of them")
    if a.num_prefix_snapshots is not None and a.num_prefix_snapshots < 0:
        raise ConfigError(f"num_prefix_snapshots={a.num_prefix_snapshots} must be >= 0")
