"""The facade: load a checkpoint, generate (batch or streaming), score, stats.

Everything that can be wrong with a configuration or an input is checked before any model
work: configuration at construction (before weights are read), prompts and sampling values
when they are added.
"""

import contextlib
import dataclasses
import itertools
import numbers
import operator
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch

from mtpkit.checkpoint.hub import resolve_model
from mtpkit.config import EngineConfig, resolve_device, resolve_dtype
from mtpkit.engine import memory_plan
from mtpkit.engine.allocators import SlotAllocator
from mtpkit.engine.kv_pools import KVPools, check_pool_sizes, pool_sizes
from mtpkit.engine.request import Request, RequestOutput, SpecStats, Status
from mtpkit.engine.runner import ModelRunner
from mtpkit.engine.scheduler import Scheduler
from mtpkit.errors import ConfigError, InputError
from mtpkit.graphs.plan import build_capture_plan
from mtpkit.models.registry import read_config
from mtpkit.sampling.params import SamplingParams
from mtpkit.speculative.setup import setup_drafter
from mtpkit.step.cache import allocate_cache
from mtpkit.step.cache_spec import CacheSpec
from mtpkit.text.chat import load_chat_template, special_tokens
from mtpkit.text.detokenize import IncrementalDetokenizer
from mtpkit.text.generation_config import read_generation_defaults
from mtpkit.text.stop_strings import StopStringMatcher, cut_at_stop
from mtpkit.text.tokenizer import load_tokenizer
from mtpkit.engine.inputs import (id_sequence, is_bool, normalize_sampling_params, prompt_list, short_repr,
                                  utf8_text)

Prompt = str | Sequence[int]


@dataclasses.dataclass
class StreamEvent:
    """One request's increment after a step."""

    index: int                      # position of the prompt in the call
    new_token_ids: list[int]
    text: str                       # all final text so far (the whole text on the finishing event)
    finished: bool
    output: RequestOutput
    delta: str = ""                 # text that became final at this event (never half a character)


class LLM:
    def __init__(self, model: str | Path, *, num_spec: int = 0, draft_model: str | Path | None = None,
                 max_num_seqs: int = 8,
                 max_model_len: int | None = None, dtype="auto", device=None,
                 enforce_eager: bool = False, seed: int = 0, block_size: int = 16,
                 num_blocks: int | None = None, num_state_slots: int | None = None,
                 kv_cache_memory: int | None = None, state_cache_memory: int | None = None,
                 gpu_memory_utilization: float | None = None, memory_budget: int | None = None,
                 max_num_batched_tokens: int = 2048,
                 graph_sizes: Sequence[int] | None = None,
                 cudagraph_capture_sizes: Sequence[int] | None = None,
                 attn_backend: str | None = None, tensor_parallel_size: int | None = None,
                 load_format: str = "safetensors", num_threads: int | None = None,
                 keep_fp8: bool | None = None, recycle_sliding_kv: bool = True):
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
        """
        if load_format not in ("safetensors", "dummy"):
            raise ConfigError(f"load_format={load_format!r} must be 'safetensors' or 'dummy'")
        path = resolve_model(model)
        self.model_path = path
        self.family, cfg = read_config(path)
        self.model_config = cfg
        self.tokenizer = load_tokenizer(path, cfg.vocab_size)  # a broken file is named before weights load
        self.generation_defaults = read_generation_defaults(path, cfg, self.tokenizer)
        self._chat_template, self._special_tokens = load_chat_template(path), special_tokens(path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, cfg.torch_dtype)
        if not isinstance(recycle_sliding_kv, bool):
            raise ConfigError(f"recycle_sliding_kv={recycle_sliding_kv!r} must be True or False")
        for name, v in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("seed", seed),
                        ("max_model_len", max_model_len), ("num_blocks", num_blocks),
                        ("num_state_slots", num_state_slots), ("kv_cache_memory", kv_cache_memory),
                        ("state_cache_memory", state_cache_memory), ("num_threads", num_threads),
                        ("memory_budget", memory_budget)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(f"{name}={v!r} must be an int")
        if keep_fp8 is not None and not isinstance(keep_fp8, bool):
            raise ConfigError(f"keep_fp8={keep_fp8!r} must be True, False or None (None: keep FP8 weights on CUDA)")
        if num_threads is not None and num_threads < 1:
            raise ConfigError(f"num_threads={num_threads} must be >= 1")
        if not isinstance(num_spec, int) or isinstance(num_spec, bool) or not 0 <= num_spec <= 8:
            raise ConfigError(f"num_spec={num_spec!r} must be an int in 0..8")
        for name, v in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if v < 1:
                raise ConfigError(f"{name}={v} must be >= 1")
        # The drafter, from config.json files alone (and the checkpoint's headers).
        self.draft = draft = setup_drafter(self.family, cfg, path, num_spec=num_spec, draft_model=draft_model,
                                           block_size=block_size, load_format=load_format)
        model_cls, target_kwargs = self.family.model_class, (draft.target_kwargs if draft else {})
        # Tensor parallelism: what config.json cannot split is refused first, then a size that
        # differs from the launched job.
        from mtpkit.parallel import TP

        def check_tp(size: int) -> None:
            model_cls.check_tensor_parallel(cfg, size, **target_kwargs)
            if draft is not None:
                draft.check_tensor_parallel(size)
        if isinstance(tensor_parallel_size, int):
            check_tp(tensor_parallel_size)
        self.tp = tp = TP.launched(tensor_parallel_size, self.device)
        check_tp(tp.size)
        self.device = tp.rank_device(self.device)
        if max_model_len is None:
            max_model_len = min(cfg.max_position_embeddings, 4096)
        if max_model_len < 2 or max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len={max_model_len} must be in 2..max_position_embeddings="
                              f"{cfg.max_position_embeddings}")
        self.engine_config = ecfg = EngineConfig(
            num_spec=num_spec, kv_lookahead=draft.kv_lookahead if draft else 0,
            kv_read_back=draft.kv_read_back if draft else 0, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens)
        bundle = ecfg.bundle
        # Every cache tensor the model and its drafter declare; pool sizes: explicit counts,
        # else a memory budget over exactly those tensors, else enough for the workload. A
        # sliding-window pool is sized from its window (kv_pools.pool_sizes); num_blocks and
        # kv_cache_memory size the full-attention pool (what is left after the sliding ones).
        self.cache_spec = spec = model_cls.cache_spec(cfg, num_spec=num_spec, tp_size=tp.size) + (
            draft.cache_spec(tp.size) if draft else CacheSpec())

        def sizes_with(full_blocks):
            return pool_sizes(spec, full_blocks=full_blocks, max_num_seqs=max_num_seqs, max_blocks=ecfg.max_blocks,
                              block_size=block_size, span=ecfg.verify_span,
                              max_num_batched_tokens=max_num_batched_tokens, read_back=ecfg.kv_read_back,
                              recycle=recycle_sliding_kv)
        self._pool_sizes = sizes_with
        full = next((p for p in spec.pools if p.sliding_window is None), None)
        self.memory_plan = None
        budget = memory_plan.budget_of(self.device, memory_budget, gpu_memory_utilization,
                                       num_blocks=num_blocks, num_state_slots=num_state_slots,
                                       kv_cache_memory=kv_cache_memory, state_cache_memory=state_cache_memory)
        if budget is not None:  # the weights and a first plan before any weight is read
            self._meta = memory_plan.meta_models(self.family, cfg, draft, path=path, load_format=load_format,
                                                 device=self.device, attn_backend=attn_backend, tp=tp,
                                                 keep_fp8=keep_fp8)
            self.memory_plan = plan = self._plan_memory(budget, spec, activation_bytes=None)
            num_blocks, num_state_slots = plan.num_blocks, plan.num_slots
            if self.device.type == "cuda":  # a provisional KV pool for the profile run (one request)
                num_blocks = 1 + ecfg.max_blocks
        if num_blocks is None:
            if kv_cache_memory is not None:
                sliding = sum(n * p.bytes_per_block(block_size, self.dtype)
                              for p, n in zip(spec.pools, sizes_with(0).values()) if p.sliding_window is not None)
                per_block = full.bytes_per_block(block_size, self.dtype) if full else 1
                num_blocks = max((kv_cache_memory - sliding) // per_block, 0)
            else:
                num_blocks = 1 + max_num_seqs * ecfg.max_blocks
        self.kv_pool_sizes = sizes = sizes_with(num_blocks)
        check_pool_sizes(spec, sizes, max_blocks=ecfg.max_blocks, block_size=block_size, span=ecfg.verify_span,
                         max_num_batched_tokens=max_num_batched_tokens, read_back=ecfg.kv_read_back,
                         max_model_len=max_model_len, recycle=recycle_sliding_kv)
        given = num_state_slots is not None  # else from state_cache_memory, or the default
        if not spec.has_state:
            num_state_slots = None   # nothing to hold: requests take no slots
        elif num_state_slots is None:
            if state_cache_memory is not None:
                per_slot = spec.bytes_per_slot(self.dtype)
                num_state_slots = state_cache_memory // per_slot
            else:
                num_state_slots = 1 + max_num_seqs * bundle
        if num_state_slots is not None and num_state_slots < 1 + bundle:
            need, full = 1 + bundle, 1 + max_num_seqs * bundle
            if given or state_cache_memory is None:
                source, fix = f"num_state_slots={num_state_slots}", "num_state_slots"
            else:
                source = f"state_cache_memory={state_cache_memory} ({num_state_slots} state slots)"
                fix, need, full = "state_cache_memory", need * per_slot, full * per_slot
            raise ConfigError(f"{source}: the recurrent-state pool holds no request; each request needs "
                              f"num_spec + 1 = {bundle} state slots plus one shared null slot, so give "
                              f"{fix} >= {need} ({full} for max_num_seqs={max_num_seqs}), or leave it unset")
        # Graph plan (and its configuration errors) before any weight is read.
        max_state_reqs = max_num_seqs if num_state_slots is None else (num_state_slots - 1) // bundle
        self.capture_plan = build_capture_plan(
            num_spec=num_spec, max_num_seqs=max_num_seqs, max_state_reqs=max_state_reqs,
            graph_sizes=graph_sizes, cudagraph_capture_sizes=cudagraph_capture_sizes)
        from mtpkit.checkpoint.loader import build_model, checkpoint_index
        from mtpkit.kernels.ops import select_ops

        # Reading weights can fail on one rank only (a bad file, memory): every rank finishes
        # this block, then all learn of any failure and raise, instead of the others hanging.
        error, drafter = None, None
        try:
            if load_format == "safetensors":
                checkpoint_index(path)  # a missing or broken weights file is reported before any work
                if draft is not None:
                    draft.check_checkpoint()
            backend = select_ops(self.device, attn_backend)

            def load(family, model_cfg, model_path, **kwargs):
                return build_model(family, model_cfg, model_path, ops=backend, tp=tp, dtype=self.dtype,
                                   device=self.device, load_format=load_format, seed=seed, keep_fp8=keep_fp8,
                                   **kwargs)
            self.model = load(self.family, cfg, path, **target_kwargs)
            drafter = draft.build(self.model, load=load) if draft else None
            self.cache = allocate_cache(spec, num_blocks=sizes, num_slots=num_state_slots or 0,
                                        block_size=block_size, dtype=self.dtype, device=self.device)
        except Exception as e:
            error = e
        tp.raise_if_any_failed(error, "loading the model")
        self.drafter = drafter
        self._enforce_eager, self._recycle = enforce_eager, recycle_sliding_kv
        self._make_engine(sizes, num_state_slots)
        self.eos_token_ids = self.generation_defaults.eos_token_ids
        if self.device.type == "cpu":
            params = sum(p.numel() for p in self.model.parameters())
            threads = num_threads if num_threads is not None else (1 if params < 50_000_000 else None)
            if threads is not None and threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self.seed = seed
        self._ids = itertools.count()
        self.stats = SpecStats(num_spec=num_spec)
        if self.memory_plan is not None:
            if self.device.type == "cuda":  # activations measured, then the pools at their planned sizes
                self._resize_pools(budget)
            del self._meta
            print(self.memory_plan.summary(), file=sys.stderr, flush=True)

    def _make_engine(self, pool_sizes: dict[str, int], num_state_slots: int | None) -> None:
        ecfg = self.engine_config
        self.kv_pools = KVPools(self.cache_spec.pools, pool_sizes, block_size=ecfg.block_size,
                                max_positions=ecfg.max_positions, read_back=ecfg.kv_read_back,
                                recycle=self._recycle)
        self.slots = SlotAllocator(num_state_slots, ecfg.bundle)
        dispatch = None if self._enforce_eager else self.capture_plan.dispatch
        self.scheduler = Scheduler(ecfg, self.kv_pools, self.slots, dispatch)
        self.runner = ModelRunner(self.model, self.drafter, self.cache, ecfg, self.device,
                                  None if self._enforce_eager else self.capture_plan)

    def _plan_memory(self, budget: tuple[int, str], spec: CacheSpec, activation_bytes: int | None):
        ecfg = self.engine_config
        source = "measured" if activation_bytes is not None else "estimated"
        if activation_bytes is None:
            activation_bytes = memory_plan.activation_estimate(
                self._meta[0], tokens=ecfg.max_num_batched_tokens, logits_rows=ecfg.max_num_seqs * ecfg.bundle,
                vocab=self.model_config.vocab_size, dtype=self.dtype)
        return memory_plan.plan_pools(
            budget=budget[0], weight_bytes=memory_plan.weight_bytes(self._meta, self.dtype),
            activation_bytes=activation_bytes, activation_source=source, spec=spec,
            block_size=ecfg.block_size, dtype=self.dtype, max_blocks=ecfg.max_blocks, bundle=ecfg.bundle,
            max_num_seqs=ecfg.max_num_seqs, max_model_len=ecfg.max_model_len, source=budget[1],
            sliding_blocks={k: n for k, n in self._pool_sizes(0).items() if k != "full"})

    def _resize_pools(self, budget: tuple[int, str]) -> None:
        """CUDA: a profile run (one prefill of max_num_batched_tokens tokens) measures the
        activations' peak; the KV pool is then allocated at the size that leaves (the state
        pool's size does not depend on it, so the capture plan stands)."""
        ecfg = self.engine_config
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.score([0] * min(ecfg.max_num_batched_tokens, ecfg.max_model_len))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.memory_plan = plan = self._plan_memory(budget, self.cache_spec, activation_bytes=peak)
        del self.cache, self.runner
        torch.cuda.empty_cache()
        self.kv_pool_sizes = sizes = self._pool_sizes(plan.num_blocks)
        self.cache = allocate_cache(self.cache_spec, num_blocks=sizes, num_slots=plan.num_slots or 0,
                                    block_size=ecfg.block_size, dtype=self.dtype, device=self.device)
        self._make_engine(sizes, plan.num_slots)

    # ---- inputs ---------------------------------------------------------------------
    def _tokens(self, prompt: Prompt, where: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError(f"{where}: this checkpoint has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(utf8_text(prompt, where)).ids
        else:
            ids, bad, not_ints = [], [], []
            for t in id_sequence(prompt, where):  # Python, numpy and torch integers; not bools or floats
                try:
                    if is_bool(t):
                        raise TypeError
                    t = operator.index(t)
                except TypeError:
                    bad.append(t), not_ints.append(type(t).__name__)
                    continue
                ids.append(t)
                if not 0 <= t < self.model_config.vocab_size:
                    bad.append(t)
            if bad:
                raise InputError(f"{where}: token ids {bad[:8]} are outside the vocabulary "
                                 f"0..{self.model_config.vocab_size - 1}" + (
                                     f" (token ids are integers, not {', '.join(sorted(set(not_ints)))})"
                                     if not_ints else ""))
        if not ids:
            raise InputError(f"{where}: the prompt is empty; give at least one token")
        return ids

    def _validate(self, prompt: Prompt, params: SamplingParams | None, where: str
                  ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and its SamplingParams (scalars as Python values), or an
        InputError naming `where`."""
        try:  # no SamplingParams: the checkpoint's generation_config.json defaults
            params = normalize_sampling_params(params if params is not None else self.generation_defaults.sampling_params())
            params.validate(self.model_config.vocab_size)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        if params.stop and self.tokenizer is None:
            raise InputError(f"{where}: stop strings need the checkpoint's tokenizer.json, which this one lacks; "
                             "use stop_token_ids")
        ids = self._tokens(prompt, where)
        total, limit = len(ids) + params.max_tokens, self.engine_config.max_model_len
        if total > limit:
            raise InputError(f"{where}: {len(ids)} prompt tokens + max_tokens={params.max_tokens} = {total} "
                             f"exceeds max_model_len={limit}; shorten the prompt, lower max_tokens or "
                             "raise max_model_len")
        return ids, params

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    where: str = "prompt") -> Request:
        """Validate and queue one request (raises InputError; queued requests are unaffected)."""
        return self._enqueue(*self._validate(prompt, params, where))

    def _enqueue(self, ids: list[int], params: SamplingParams) -> Request:
        """Queue an already validated request."""
        ecfg = self.engine_config
        rid = next(self._ids)
        # A random request's tokens are drawn from noise keyed by (seed, token position)
        # (mtpkit.sampling.sampler): without a seed of its own it gets a fixed one from LLM.seed and
        # its id, so it too is reproducible under preemption.
        seed = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else hash((self.seed, rid)) & (2**63 - 1)
        req = Request(rid, ids, params, () if params.ignore_eos else self.eos_token_ids, seed)
        req.stats.num_spec = ecfg.num_spec
        if params.stop:
            req.stop_matcher = StopStringMatcher(self.tokenizer, params.stop)
        self.scheduler.add(req)
        return req

    # ---- running --------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one engine step; returns the requests it advanced."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        try:
            results = self.runner.execute(plan)
            finished = self.scheduler.update(plan, results)
        except BaseException:
            # Interrupted mid-step (Ctrl-C, an error): its caches may be written and its results
            # not applied. The step's requests start over; the caller's stream aborts its own.
            self.scheduler.recompute(plan.reqs)
            raise
        for r in finished:
            self.stats.merge(r.stats)
        return plan.reqs

    def abort(self, request_ids: int | Sequence[int]) -> list[int]:
        """Stop requests now: they leave the queue, their KV blocks and state slots are freed,
        and they finish with finish_reason "abort" (a stream that holds one yields it as
        finished). request_ids: RequestOutput.request_id / Request.req_id values. Ids that are
        unknown or already finished are ignored, so aborting twice is harmless; returns the
        ids that were aborted."""
        try:
            ids = ({operator.index(request_ids)} if isinstance(request_ids, numbers.Integral)
                   else {operator.index(i) for i in request_ids})
        except TypeError:
            raise InputError(f"request_ids={short_repr(request_ids)} must be an id or a list of ids "
                             "(RequestOutput.request_id, Request.req_id)") from None
        sched = self.scheduler
        reqs = [r for r in itertools.chain(sched.waiting, sched.running) if r.req_id in ids]
        return sorted(r.req_id for r in sched.abort(reqs))

    def _prepare(self, prompts, sampling_params, errors: str):
        prompts = prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InputError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if errors not in ("raise", "return"):
            raise InputError(f"errors={errors!r} must be 'raise' or 'return'")
        # Validate every prompt before queueing any, so a bad one costs no model work.
        problems, valid = {}, {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                valid[i] = self._validate(p, sp, f"prompt {i}")
            except InputError as e:
                problems[i] = str(e)
        if problems and errors == "raise":
            raise InputError("; ".join(problems.values()) + (
                "" if len(prompts) == 1 else " (nothing was run; pass errors='return' to run the valid "
                "prompts and get the errors back as outputs)"))
        reqs = {}
        try:
            for i, (ids, sp) in valid.items():
                reqs[i] = self._enqueue(ids, sp)
        except BaseException:  # all or nothing: an interrupt here leaves no request queued
            self.scheduler.abort(list(reqs.values()))
            raise
        return prompts, reqs, problems

    def stream(self, prompts, sampling_params=None, *, errors: str = "raise") -> Iterator[StreamEvent]:
        """Yield each request's new tokens after every step, until all have finished. If the
        generator is closed or collected early, or a step raises (KeyboardInterrupt included),
        this call's requests are aborted: their storage is freed and none of them runs later."""
        prompts, reqs, problems = self._prepare(prompts, sampling_params, errors)
        try:
            for i, msg in problems.items():
                yield StreamEvent(i, [], "", True, self._error_output(prompts[i], msg))
            index = {r.req_id: i for i, r in reqs.items()}
            seen = {r.req_id: 0 for r in reqs.values()}
            detok = {r.req_id: IncrementalDetokenizer(self.tokenizer, stop=r.params.stop) for r in reqs.values()}
            live = {r.req_id: r for r in reqs.values()}
            while live:
                stepped = self.step()
                # Requests aborted meanwhile (LLM.abort) are in no step: report them too.
                aborted = [r for r in live.values() if r.status == Status.FINISHED and r not in stepped]
                for r in stepped + aborted:
                    if r.req_id not in live:
                        continue
                    # read before yielding: the caller may abort r meanwhile, which must
                    # still be reported on the next round
                    new, finished = r.output_token_ids[seen[r.req_id]:], r.status == Status.FINISHED
                    if new or finished:
                        seen[r.req_id] = len(r.output_token_ids)
                        out, d = self._output(r), detok[r.req_id]
                        delta = d.add(new, final=out.finished)
                        yield StreamEvent(index[r.req_id], new, d.text, out.finished, out, delta)
                    if finished:
                        del live[r.req_id]
        finally:
            self.scheduler.abort(list(reqs.values()))

    def generate(self, prompts, sampling_params=None, *, errors: str = "raise",
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. prompts: a str, a list of token ids, or a
        list of those (see prompt_list). errors='raise' refuses the whole call if any prompt
        is bad (before any model work); errors='return' runs the others and returns the bad
        ones with .error set. An exception (KeyboardInterrupt included) aborts the call's
        requests before it propagates."""
        outputs: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(desc="generating", unit="tok")
        # closing: an exception here would otherwise keep the stream (and its requests) alive
        # in the traceback until it is collected.
        with contextlib.closing(self.stream(prompts, sampling_params, errors=errors)) as events:
            for ev in events:
                if bar is not None:
                    bar.update(len(ev.new_token_ids))
                if ev.finished:
                    outputs[ev.index] = ev.output
        if bar is not None:
            bar.close()
        return [outputs[i] for i in sorted(outputs)]

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, chat_template: str | None = None,
                            tokenize: bool = True, **template_kwargs) -> list:
        """Each conversation of `messages` (a list of {"role", "content"} dicts, or a list of
        such lists) rendered by the checkpoint's chat template (or `chat_template`: a template
        or the name of one of the checkpoint's), as token ids (tokenize=True) or text; one
        entry per conversation. Extra keyword arguments are template variables."""
        from mtpkit.text.chat import conversation_list, render_chat, select_template
        source = select_template(self._chat_template, chat_template, str(self.model_path))
        convs = conversation_list(messages)
        where = (lambda i: f"conversation {i}") if len(convs) > 1 else (lambda i: "conversation")
        texts = [render_chat(source, c, add_generation_prompt=add_generation_prompt, special=self._special_tokens,
                             where=where(i), **template_kwargs) for i, c in enumerate(convs)]
        if not tokenize:
            return texts
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer.json to encode the rendered chat; pass tokenize=False")
        # the template writes the special tokens itself
        return [self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]

    def chat(self, messages, sampling_params=None, *, add_generation_prompt: bool = True,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             errors: str = "raise", use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate a reply to each conversation (a list of message dicts, or a list of
        conversations): rendered by apply_chat_template, then generate(); one RequestOutput per
        conversation. Without sampling_params the checkpoint's generation_config.json defaults
        apply. Every conversation is rendered before any runs."""
        ids = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, **(chat_template_kwargs or {}))
        return self.generate(ids if len(ids) > 1 else ids[0], sampling_params, errors=errors, use_tqdm=use_tqdm)

    def _output(self, r: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = cut_at_stop(self.tokenizer.decode(r.output_token_ids), r.params.stop)
        return RequestOutput(r.req_id, list(r.prompt_token_ids), list(r.output_token_ids), text,
                             r.finish_reason, r.stats, None, r.num_preemptions,
                             list(r.token_steps), list(r.token_draft_positions), self.tokenizer)

    def _error_output(self, prompt, msg: str) -> RequestOutput:
        try:  # the ids as far as they can be read: a bad prompt may be anything
            ids = [] if isinstance(prompt, str) else id_sequence(prompt, "")
        except InputError:
            ids = []
        return RequestOutput(-1, ids, [], None, "error", SpecStats(), msg)

    # ---- scoring --------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [seq, vocab] of every position of one sequence, through the engine's
        (chunked) prefill path."""
        ids = self._tokens(token_ids, "score")
        ecfg = self.engine_config
        if len(ids) > ecfg.max_model_len:
            raise InputError(f"score: {len(ids)} tokens exceed max_model_len={ecfg.max_model_len}")
        chunk_len = min(ecfg.max_num_batched_tokens, len(ids))
        slots = self.slots.allocate() if self.kv_pools.can_hold(len(ids), chunk_len) else None
        if slots is None:
            raise InputError("score: the caches are full with running requests; call it when they finish")
        from mtpkit.step.metadata import PrefillChunk
        tables = self.kv_pools.new_tables()
        try:
            out, start = [], 0
            while start < len(ids):
                n = min(chunk_len, len(ids) - start)
                held = self.kv_pools.ensure(tables, start, start + n)
                assert held, "the pools held the whole sequence's peak when the call began"
                chunk = PrefillChunk(ids[start:start + n], start, [t.ids for t in tables], slots)
                hidden, _, _ = self.runner.prefill_hidden([chunk])
                out.append(self.model.compute_logits(hidden).float())
                start += n
            return torch.cat(out)
        finally:
            self.kv_pools.release(tables)
            self.slots.free(slots)


