"""Building an engine from a checkpoint.

Everything that can be wrong with a configuration is found before any weight is read, in this
order: the load format, the checkpoint's config.json (open_checkpoint); then (build_engine) the
device and dtype, the arguments' types and ranges (engine/args.py), the drafter (from config.json
files and headers alone), tensor parallelism, max_model_len, every pool's size (a memory budget's
plan included: engine/pool_sizing.py) and the graph plan. Then the weights are read on every
rank, the caches allocated, the scheduler and runner built, CPU threads chosen and, with a
budget on CUDA, a profile run measures the activations and the KV pool is resized to what is
left.
"""

import dataclasses
import sys
from pathlib import Path

import torch

from mtpkit.checkpoint.hub import resolve_model
from mtpkit.checkpoint.loader import checkpoint_fp8
from mtpkit.config import EngineConfig, resolve_device, resolve_dtype
from mtpkit.engine import cpu_threads, memory_plan
from mtpkit.engine.args import EngineArgs, check_args, check_load_format
from mtpkit.engine.engine import Engine
from mtpkit.engine.pool_sizing import (PoolSizes, check_pools_fit, kv_pool_sizes, plan_memory, prefix_snapshots,
                                       size_pools)
from mtpkit.errors import ConfigError
from mtpkit.graphs.plan import build_capture_plan
from mtpkit.models.registry import ModelFamily, read_config
from mtpkit.parallel import TP
from mtpkit.speculative.drafter import DraftSetup
from mtpkit.speculative.setup import setup_drafter
from mtpkit.step.cache import allocate_cache
from mtpkit.step.cache_spec import CacheSpec


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint directory, its model family and its parsed config.json."""

    path: Path
    family: ModelFamily
    config: object


def open_checkpoint(model: str | Path, load_format: str) -> Checkpoint:
    check_load_format(load_format)
    path = resolve_model(model)
    family, cfg = read_config(path)
    return Checkpoint(path, family, cfg)


def build_engine(ckpt: Checkpoint, args: EngineArgs) -> Engine:
    cfg, a = ckpt.config, args
    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device, cfg.torch_dtype)
    check_args(a)
    if a.keep_fp8 and checkpoint_fp8(ckpt.path) is None:
        raise ConfigError(f"keep_fp8=True (--fp8-weights keep): {ckpt.path} has no FP8 weights (its config.json has no "
                          "quantization_config with quant_method 'fp8'), so there is nothing to keep; leave keep_fp8 "
                          "unset")
    draft = setup_drafter(ckpt.family, cfg, ckpt.path, num_spec=a.num_spec, draft_model=a.draft_model,
                          block_size=a.block_size, load_format=a.load_format)
    tp = tensor_parallel(ckpt, draft, a.tensor_parallel_size, device)
    draft_dtype = resolve_draft_dtype(a, draft, device, dtype, tp.size)
    check_scheduler_steps(a.num_scheduler_steps, device, tp.size)
    device = tp.rank_device(device)
    ecfg = engine_config(cfg, draft, a)
    # Every cache tensor the model and its drafter declare.
    spec = ckpt.family.model_class.cache_spec(cfg, num_spec=a.num_spec, tp_size=tp.size) + (
        draft.cache_spec(tp.size) if draft else CacheSpec())
    num_blocks, num_state_slots, plan, meta = a.num_blocks, a.num_state_slots, None, None
    snapshots = prefix_snapshots(spec, ecfg, enabled=a.enable_prefix_caching, num=a.num_prefix_snapshots)
    budget = memory_plan.budget_of(device, a.memory_budget, a.gpu_memory_utilization, num_blocks=a.num_blocks,
                                   num_state_slots=a.num_state_slots, kv_cache_memory=a.kv_cache_memory,
                                   state_cache_memory=a.state_cache_memory)
    if budget is not None:  # the weights and a first plan before any weight is read
        meta = memory_plan.meta_models(ckpt.family, cfg, draft, path=ckpt.path, load_format=a.load_format,
                                       device=device, attn_backend=a.attn_backend, tp=tp, keep_fp8=a.keep_fp8)
        plan = plan_memory(budget, spec, ecfg, dtype, meta=meta, vocab=cfg.vocab_size, recycle=a.recycle_sliding_kv,
                           snapshots=snapshots)
        num_blocks, num_state_slots = plan.num_blocks, plan.num_slots
        if device.type == "cuda":  # a provisional KV pool for the profile run (one request)
            num_blocks = 1 + ecfg.max_blocks
    sizes = size_pools(spec, ecfg, dtype, num_blocks=num_blocks, num_state_slots=num_state_slots,
                       kv_cache_memory=a.kv_cache_memory, state_cache_memory=a.state_cache_memory,
                       recycle=a.recycle_sliding_kv, snapshots=snapshots)
    # Graph plan (and its configuration errors) before any weight is read.
    max_state_reqs = (a.max_num_seqs if sizes.state_slots is None
                      else (sizes.state_slots - 1) // ecfg.bundle)
    capture_plan = build_capture_plan(num_spec=a.num_spec, max_num_seqs=a.max_num_seqs,
                                      max_state_reqs=max_state_reqs, graph_sizes=a.graph_sizes,
                                      cudagraph_capture_sizes=a.cudagraph_capture_sizes)
    check_pools_fit(spec, ecfg, sizes, dtype, device)
    model, drafter, cache = load_weights(ckpt, draft, a, tp, device, dtype, spec, sizes)
    if drafter is not None and draft_dtype != dtype:
        for m in drafter.own_modules():
            cast_module(m, draft_dtype)
    engine = Engine(model=model, drafter=drafter, draft=draft, family=ckpt.family, model_config=cfg, tp=tp,
                    device=device, dtype=dtype, engine_config=ecfg, cache_spec=spec, capture_plan=capture_plan, cache=cache,
                    pool_sizes=sizes, memory_plan=plan, enforce_eager=a.enforce_eager,
                    recycle_sliding_kv=a.recycle_sliding_kv, seed=a.seed,
                    prefix_caching=a.enable_prefix_caching,
                    prefix_snapshot_interval=a.prefix_snapshot_interval or max(1, 512 // a.block_size) * a.block_size)
    engine.threads_held = set_cpu_threads(model, device, a.num_threads)
    graphs = engine.runner.graphs
    if a.compile is not None and graphs is not None and graphs.trace:   # CPU traces only (not CUDA, TP, Triton)
        from mtpkit.graphs.compiled import COMPILE_AFTER, Compiler, body_modules, body_settings
        graphs.compiler = Compiler(a.compile, body_modules(model, drafter), a.compile_cache_dir,
                                   COMPILE_AFTER if a.compile_after is None else a.compile_after,
                                   settings=body_settings(engine.runner.bodies))
    if plan is not None:
        if device.type == "cuda":  # activations measured, then the pools at their planned sizes
            resize_to_measured(engine, budget, meta)
        print(engine.memory_plan.summary(), file=sys.stderr, flush=True)
    return engine


def tensor_parallel(ckpt: Checkpoint, draft: DraftSetup | None, size: int | None, device: torch.device) -> TP:
    """The launched group for `size`: what config.json cannot split is refused first, then a
    size that differs from the launched job."""
    target_kwargs = draft.target_kwargs if draft else {}

    def check(n: int) -> None:
        ckpt.family.model_class.check_tensor_parallel(ckpt.config, n, **target_kwargs)
        if draft is not None:
            draft.check_tensor_parallel(n)
    if isinstance(size, int):
        check(size)
    tp = TP.launched(size, device)
    check(tp.size)
    return tp


def engine_config(cfg, draft: DraftSetup | None, a: EngineArgs) -> EngineConfig:
    max_model_len = a.max_model_len
    if max_model_len is None:
        max_model_len = min(cfg.max_position_embeddings, 4096)
    if max_model_len < 2 or max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len={max_model_len} must be in 2..max_position_embeddings="
                          f"{cfg.max_position_embeddings}")
    return EngineConfig(num_spec=a.num_spec, kv_lookahead=draft.kv_lookahead if draft else 0,
                        kv_read_back=draft.kv_read_back if draft else 0, max_num_seqs=a.max_num_seqs,
                        max_model_len=max_model_len, block_size=a.block_size,
                        max_num_batched_tokens=a.max_num_batched_tokens, num_scheduler_steps=a.num_scheduler_steps)


def check_scheduler_steps(steps: int, device: torch.device, tp_size: int) -> None:
    """num_scheduler_steps > 1 where it runs (CPU graphs, one process), or a ConfigError."""
    if steps == 1:
        return
    if device.type != "cpu":
        raise ConfigError(f"num_scheduler_steps={steps} is CPU-only for now (a CUDA graph's replay is asynchronous: "
                          "the host's work already overlaps it); drop num_scheduler_steps")
    if tp_size > 1:
        raise ConfigError(f"num_scheduler_steps={steps} runs in one process only (under tensor parallelism rank 0 "
                          "decides every step's tokens); drop it or use tensor_parallel_size=1")


def resolve_draft_dtype(a: EngineArgs, draft: DraftSetup | None, device: torch.device, dtype: torch.dtype,
                        tp_size: int) -> torch.dtype:
    """EngineArgs.draft_dtype resolved (None / "auto": the target's `dtype`), or a ConfigError
    naming the fix, before any weight is read."""
    if a.draft_dtype is None or a.draft_dtype == "auto":
        return dtype
    try:
        draft_dtype = resolve_dtype(a.draft_dtype, device)
    except ConfigError as e:
        raise ConfigError(f"draft_dtype={a.draft_dtype!r}: {e}") from None
    if draft_dtype == dtype:
        return dtype
    where = f"draft_dtype={a.draft_dtype!r} (the target runs in {str(dtype).removeprefix('torch.')})"
    if draft is None:
        raise ConfigError(f"{where} sets the drafter's dtype, and num_spec=0 runs no drafter; set num_spec > 0 or "
                          "drop draft_dtype")
    if not draft.own_dtype:
        raise ConfigError(f"{where}: the {draft.name} drafter runs in the target's dtype (only the MTP head and the "
                          "Gemma 4 assistant run in their own); drop draft_dtype")
    if device.type != "cpu":
        raise ConfigError(f"{where} is CPU-only for now (on CUDA the drafter runs in the target's dtype, "
                          "bfloat16 by default); drop draft_dtype")
    if tp_size > 1:
        raise ConfigError(f"{where} runs in one process only for now; drop draft_dtype or use tensor_parallel_size=1")
    if a.keep_fp8:
        raise ConfigError(f"{where} casts the drafter's weights, which keep_fp8=True keeps in FP8; drop one of them")
    return draft_dtype


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """A drafter's own weights in `dtype` (EngineArgs.draft_dtype), each keeping its layout
    (Tensor.to preserves a column-major CPU weight's strides). A MoE whose two input products
    were merged into one matrix (MoE.merge_for_cpu) is merged again from the cast weights."""
    module.to(dtype)
    for m in module.modules():
        if getattr(m, "w_in13", None) is not None:
            m.w_in13 = None
            m.merge_for_cpu()


def load_weights(ckpt: Checkpoint, draft: DraftSetup | None, a: EngineArgs, tp: TP, device: torch.device,
                 dtype: torch.dtype, spec: CacheSpec, sizes: PoolSizes):
    """(the target model, its drafter or None, the caches at `sizes`)."""
    from mtpkit.checkpoint.loader import build_model, checkpoint_index
    from mtpkit.kernels.ops import select_ops

    # Reading weights can fail on one rank only (a bad file, memory): every rank finishes
    # this block, then all learn of any failure and raise, instead of the others hanging.
    error, model, drafter, cache = None, None, None, None
    try:
        if a.load_format == "safetensors":
            checkpoint_index(ckpt.path)  # a missing or broken weights file is reported before any work
            if draft is not None:
                draft.check_checkpoint()
        ops = select_ops(device, a.attn_backend)

        def load(family, model_cfg, model_path, **kwargs):
            return build_model(family, model_cfg, model_path, ops=ops, tp=tp, dtype=dtype, device=device,
                               load_format=a.load_format, seed=a.seed, keep_fp8=a.keep_fp8, **kwargs)
        model = load(ckpt.family, ckpt.config, ckpt.path, **(draft.target_kwargs if draft else {}))
        drafter = draft.build(model, load=load) if draft else None
        cache = allocate_cache(spec, num_blocks=sizes.kv, num_slots=sizes.state_slots or 0,
                               block_size=a.block_size, dtype=dtype, device=device, num_snapshots=sizes.snapshots)
    except Exception as e:
        error = e
    tp.raise_if_any_failed(error, "loading the model")
    return model, drafter, cache


def set_cpu_threads(model: torch.nn.Module, device: torch.device, num_threads: int | None) -> object | None:
    """torch's intra-op threads on CPU: `num_threads`, else 1 for models under 50M parameters
    (their ops are too small to gain from threads, and they slow down many times over when
    another process holds a core), else torch's default. The setting is process-wide and held
    with the other open engines' (engine/cpu_threads.py): returns the hold for `Engine.close`
    to release, None when this engine sets no count."""
    if device.type != "cpu":
        return None
    params = sum(p.numel() for p in model.parameters())
    threads = num_threads if num_threads is not None else (1 if params < 50_000_000 else None)
    return None if threads is None else cpu_threads.hold(threads)


def resize_to_measured(engine: Engine, budget: tuple[int, str], meta: list[torch.nn.Module]) -> None:
    """CUDA: a profile run (one prefill of max_num_batched_tokens tokens) measures the
    activations' peak; the KV pool is then allocated at the size that leaves (the state
    pool's size does not depend on it, so the capture plan stands)."""
    ecfg, device = engine.engine_config, engine.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    engine.score([0] * min(ecfg.max_num_batched_tokens, ecfg.max_model_len))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    engine.memory_plan = plan = plan_memory(budget, engine.cache_spec, ecfg, engine.dtype, meta=meta,
                                            vocab=engine.model_config.vocab_size,
                                            recycle=engine.recycle_sliding_kv, activation_bytes=peak,
                                            snapshots=engine.pool_sizes.snapshots)
    sizes = kv_pool_sizes(engine.cache_spec, ecfg, full_blocks=plan.num_blocks, recycle=engine.recycle_sliding_kv)
    engine.reallocate(PoolSizes(sizes, plan.num_slots, plan.num_snapshots), free=torch.cuda.empty_cache)
