"""The engine: a loaded model and its drafter, the caches they declared, the pools lending them,
the scheduler and the runner.

It takes requests already validated (the facade, mtpkit/llm.py, checks prompts and sampling
values against the tokenizer and max_model_len), runs steps, aborts, and scores a sequence
through its own prefill path. engine/build.py builds one from a checkpoint.
"""

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Sequence

import torch

from mtpkit.config import EngineConfig
from mtpkit.engine import cpu_threads, interrupts
from mtpkit.engine.allocators import SlotAllocator
from mtpkit.engine.follow import Leader, Op, check_caller
from mtpkit.engine.kv_pools import KVPools
from mtpkit.engine.loop import track
from mtpkit.engine.memory_plan import MemoryPlan
from mtpkit.engine.pool_sizing import PoolSizes
from mtpkit.engine.prefix_cache import PrefixCache, PrefixCacheStats
from mtpkit.engine.request import Request, SpecStats, Status
from mtpkit.engine.runner import ModelRunner
from mtpkit.engine.scheduler import Scheduler
from mtpkit.engine.step_log import StepLog
from mtpkit.errors import InputError
from mtpkit.graphs.plan import CapturePlan
from mtpkit.parallel import TP
from mtpkit.sampling.params import SamplingParams
from mtpkit.step.cache import CacheTensors, allocate_cache
from mtpkit.step.cache_spec import CacheSpec
from mtpkit.step.metadata import PrefillChunk
from mtpkit.text.stop_strings import StopStringMatcher


def _serialized(method):
    """One engine call at a time: a step, a queueing, an abort or a score from another thread
    waits for the one running (its caches, pools and scheduler lists are not shared safely).
    Every call but a step goes before the next step (`_steps_wait`): while any caller streams,
    steps run back to back, and a lock handed over unfairly would keep a new caller's requests
    out of the batch for many steps."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        check_caller(self)
        with self._turn:
            self._pending += 1
        try:
            with self._lock, _interrupts_held(self):
                return method(self, *args, **kwargs)
        finally:
            with self._turn:
                self._pending -= 1
                if not self._pending:
                    self._turn.notify_all()
    return run


def _steps_wait(method):
    """A step: after the queueings, aborts and scores already waiting, then as _serialized."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        check_caller(self)
        with self._turn:
            self._turn.wait_for(lambda: not self._pending)
        with self._lock, _interrupts_held(self):
            return method(self, *args, **kwargs)
    return run


def _interrupts_held(engine):
    """Leading a TP group (engine/follow.py), every call publishes what it does and the
    followers run the same collectives with rank 0: a Ctrl-C reaching rank 0's main thread inside
    a call would leave them in a step or a broadcast rank 0 abandoned. So while leading, the
    outermost call on the main thread holds it until the call has ended, then raises it (the
    caller's stream aborts its requests as usual, published): engine/interrupts.py."""
    return interrupts.held() if engine.leader is not None else contextlib.nullcontext()


class Engine:
    def __init__(self, *, model: torch.nn.Module, drafter, draft, family, model_config, tp: TP, device: torch.device,
                 dtype: torch.dtype, engine_config: EngineConfig, cache_spec: CacheSpec, capture_plan: CapturePlan,
                 cache: CacheTensors, pool_sizes: PoolSizes, memory_plan: MemoryPlan | None, enforce_eager: bool,
                 recycle_sliding_kv: bool, seed: int, prefix_caching: bool = False,
                 prefix_snapshot_interval: int = 512):
        """`draft`: the drafter's set-up (speculative.setup), `drafter` the one it built; both
        None without speculation. `enforce_eager` False: verify steps replay `capture_plan`'s
        graphs."""
        self.model, self.drafter, self.draft, self.tp = model, drafter, draft, tp
        self.family, self.model_config = family, model_config
        self.device, self.dtype, self.engine_config, self.cache_spec = device, dtype, engine_config, cache_spec
        self.capture_plan, self.memory_plan, self.seed = capture_plan, memory_plan, seed
        self.enforce_eager, self.recycle_sliding_kv = enforce_eager, recycle_sliding_kv
        self.prefix_caching, self.prefix_snapshot_interval = prefix_caching, prefix_snapshot_interval
        self.stats = SpecStats(num_spec=engine_config.num_spec)
        self._ids = itertools.count()
        self.threads_held: object | None = None   # this engine's hold on torch's thread count (cpu_threads)
        self.closed = False
        self._lock = threading.RLock()
        self._turn, self._pending = threading.Condition(threading.Lock()), 0   # calls waiting to go before a step
        # Steps under way and ended, for callers that wait for another's step (advance)
        self._steps = threading.Condition(threading.Lock())
        self._stepping, self._steps_ended, self._last_advanced = 0, 0, []
        # Tensor parallelism led by rank 0 (engine/follow.py): rank 0's publisher of its ops, or
        # on a follower the thread replaying them.
        self.leader: Leader | None = None
        self.follower_thread: int | None = None
        self.step_log = StepLog()   # the last steps' request ids and token counts (engine/step_log.py)
        self._assemble(cache, pool_sizes)

    def next_id(self) -> int:
        """A request id never given before (refused prompts get one too: every output's id is unique)."""
        return next(self._ids)

    def resume_ids(self, first_id: int) -> None:
        """A follower: the next request id is rank 0's (engine/follow.py)."""
        self._ids = itertools.count(first_id)

    @_serialized
    def lead(self, on: bool) -> None:
        """Rank 0 of a TP group: publish (on) or stop publishing (off: what is unfinished is
        aborted, then the followers' `follow` returns) every op from now on (engine/follow.py)."""
        if on and self.leader is None:
            self.leader = Leader(self.tp, self.device)
        elif not on and self.leader is not None:
            self.abort(self.scheduler.unfinished())   # published: the followers free theirs too
            self.leader.publish(Op("end"))
            self.leader = None

    def _publish(self, op: Op) -> None:
        if self.leader is not None:
            self.leader.publish(op)

    def _check_open(self) -> None:
        if self.closed:
            raise InputError("this LLM was closed (LLM.close, or the end of its `with` block); create a new one")

    @_serialized
    def close(self) -> None:
        """Abort what is queued or running, drop the caches and the captured steps, and give back
        torch's thread count when no other open engine holds one and the user did not change it
        since (engine/cpu_threads.py). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.leader is not None:   # the followers close theirs (and abort the same requests)
            self.leader.publish(Op("close"))
            self.leader = None
        self.abort(self.scheduler.unfinished())
        if self.threads_held is not None:
            cpu_threads.release(self.threads_held)
            self.threads_held = None
        self.runner.structured.close()   # the grammar masks' worker thread
        del self.runner, self.cache

    def _assemble(self, cache: CacheTensors, sizes: PoolSizes) -> None:
        """The pools over `cache` at `sizes`, the scheduler lending them, the runner on them."""
        ecfg = self.engine_config
        self.cache, self.kv_pool_sizes, self.pool_sizes = cache, sizes.kv, sizes
        self.prefix_cache = None
        if self.prefix_caching:
            # What besides the tokens decides a block's KV: the model, the drafter (its KV
            # groups share the blocks), the dtype, the block size.
            salt = "|".join(map(str, (self.family.model_type, getattr(self.model_config, "name_or_path", ""),
                                      self.draft.name if self.draft else None, self.dtype, ecfg.block_size)))
            self.prefix_cache = PrefixCache(
                salt=salt, lookahead=bool(self.draft and self.draft.kv_reads_next_token), block_size=ecfg.block_size,
                pool_names=[p.name for p in self.cache_spec.pools],
                num_snapshots=sizes.snapshots if self.cache_spec.has_state else None,
                snapshot_interval=self.prefix_snapshot_interval)
        self.kv_pools = KVPools(self.cache_spec.pools, sizes.kv, block_size=ecfg.block_size,
                                max_positions=ecfg.max_positions, read_back=ecfg.kv_read_back,
                                recycle=self.recycle_sliding_kv,
                                caches=self.prefix_cache.blocks if self.prefix_cache else None)
        self.slots = SlotAllocator(sizes.state_slots, ecfg.bundle)
        dispatch = None if self.enforce_eager else self.capture_plan.dispatch
        self.scheduler = Scheduler(ecfg, self.kv_pools, self.slots, dispatch, self.prefix_cache)
        self.runner = ModelRunner(self.model, self.drafter, self.cache, ecfg, self.device,
                                  None if self.enforce_eager else self.capture_plan)

    def reallocate(self, sizes: PoolSizes, free=lambda: None) -> None:
        """Caches at new sizes (the CUDA profile run's plan). The old caches, and the runner
        whose graphs hold them, are dropped and `free` runs (torch.cuda.empty_cache) before the
        new ones are allocated, so both never take memory at once."""
        self.runner.structured.close()
        del self.cache, self.runner
        free()
        cache = allocate_cache(self.cache_spec, num_blocks=sizes.kv, num_slots=sizes.state_slots or 0,
                               block_size=self.engine_config.block_size, dtype=self.dtype, device=self.device,
                               num_snapshots=sizes.snapshots)
        self._assemble(cache, sizes)

    # ---- requests -------------------------------------------------------------------
    @_serialized
    def add(self, ids: list[int], params: SamplingParams, *, eos_token_ids: tuple[int, ...],
            stop_matcher: StopStringMatcher | None = None, new_grammar=None) -> Request:
        """Queue a validated request (prompt ids in the vocabulary, within max_model_len with
        its max_tokens; params normalized and validated). Returns it; with params.n > 1 it is
        sample 0 of req.samples, the n requests of the prompt (ids consecutive). `new_grammar`:
        makes a request's structured outputs matcher (structured.matcher.RequestGrammar; one per
        sample), or None."""
        self._check_open()
        # A random request's tokens are drawn from noise keyed by (seed, token position)
        # (mtpkit.sampling.sampler): without a seed of its own it gets a fixed one from the
        # engine's seed and its id, so it too is reproducible under preemption. Sample i of a
        # seeded request draws as a request of seed + i would (modulo 2**64, as every seed).
        samples = []
        for i in range(params.n):
            rid = self.next_id()
            seed = None
            if params.temperature > 0:
                seed = (params.seed + i) % 2**64 if params.seed is not None else hash((self.seed, rid)) & (2**63 - 1)
            req = Request(rid, ids, params, eos_token_ids, seed, sample_index=i)
            req.stats.num_spec = self.engine_config.num_spec
            req.grammar = new_grammar() if new_grammar is not None else None
            # each sample matches stop strings in its own text
            req.stop_matcher = stop_matcher if i == 0 or stop_matcher is None else \
                StopStringMatcher(stop_matcher.tokenizer, stop_matcher.stops)
            samples.append(req)
        first = samples[0]
        if len(samples) > 1:
            for r in samples:
                r.samples = samples
            if len(ids) > 1:   # the prompt up to its last token is prefilled once, by sample 0
                first.forks, first.fork_at = samples[1:], len(ids) - 1
        for r in samples:
            track(r)   # an asyncio call's thread records its requests, to abort them if cancelled (engine/loop.py)
        for r in samples if not first.forks else [first]:
            self.scheduler.add(r)
        self._publish(Op("add", tuple(ids), params, first.req_id))
        return first

    def step(self) -> list[Request]:
        """Run one step; returns the requests it advanced."""
        with self._steps:
            self._stepping += 1
        return self._step_and_tell()

    def advance(self) -> list[Request]:
        """The requests the next step to end advanced: if another caller is running a step, wait
        for that step's end (not for the engine's lock, which the caller would take only after
        the step, and then run a step of its own before reporting anything); else run one here.
        A streaming caller reports its tokens at every step this way, whoever ran it
        (engine/loop.py). After a step that raised elsewhere, [] (the caller's next advance
        steps itself)."""
        interrupts.raise_pending()   # a Ctrl-C held in a finalizer that ran since (engine/interrupts.py)
        with self._steps:
            if self._stepping:
                ended = self._steps_ended
                while self._steps_ended == ended:
                    self._steps.wait(0.05)   # a timeout: an interrupt of the main thread is seen
                return self._last_advanced
            self._stepping += 1
        return self._step_and_tell()

    def _step_and_tell(self) -> list[Request]:
        """_step(), counted as under way (self._stepping, already raised) until it ends; then the
        callers waiting in advance() are woken with what it advanced."""
        advanced = []
        try:
            advanced = self._step()
            return advanced
        finally:
            with self._steps:
                self._stepping -= 1
                self._steps_ended += 1
                self._last_advanced = advanced
                self._steps.notify_all()

    @_steps_wait
    def _step(self) -> list[Request]:
        self._check_open()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        self._publish(Op("step"))   # a follower's scheduler makes the same plan
        start = time.monotonic()
        try:
            results = self.runner.execute(plan)
            finished = self.scheduler.update(plan, results)
        except BaseException:
            # Interrupted mid-step (Ctrl-C, an error): its caches may be written and its results
            # not applied. The step's requests start over (and the samples it forked, whose
            # copies may not have run); the caller's stream aborts its own.
            self.scheduler.recompute(plan.reqs + [r for r in plan.forked if r not in plan.reqs])
            if self.prefix_cache is not None:   # snapshots whose saves may not have run
                snaps = self.prefix_cache.snapshots
                snaps.pinned.clear()
                for entry in [sv.entry for sv in plan.copies.saves] + [e for _, _, e in plan.snapshots]:
                    snaps.drop(entry)
            raise
        for r in finished:
            self.stats.merge(r.stats)
        self.step_log.record(plan.kind.value, tuple(r.req_id for r in plan.reqs), self.scheduler.num_appended, start)
        return plan.reqs

    @_serialized
    def abort(self, reqs: Sequence[Request]) -> list[Request]:
        """Finish the unfinished ones of `reqs` with "abort" (blocks and slots freed now);
        returns those it aborted."""
        self._publish_abort(reqs)
        return self.scheduler.abort(list(reqs))

    def _publish_abort(self, reqs: Sequence[Request]) -> None:
        ids = tuple(r.req_id for r in reqs if r.status != Status.FINISHED)
        if ids:
            self._publish(Op("abort", ids))

    @_serialized
    def abort_ids(self, request_ids: set[int]) -> list[int]:
        """abort() the queued and running requests with these ids; returns their ids, sorted."""
        sched = self.scheduler
        reqs = [r for r in sched.unfinished() if r.req_id in request_ids]
        self._publish_abort(reqs)
        return sorted(r.req_id for r in sched.abort(reqs))

    # ---- prefix caching -------------------------------------------------------------
    @_serialized
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and state snapshot (vLLM's reset_prefix_cache). Refused
        (False, nothing changed) while requests are queued or running: their blocks are in
        use and their steps would key more. True when done (or no prefix cache)."""
        if self.scheduler.has_unfinished():
            return False
        if self.prefix_cache is not None:
            self.kv_pools.forget_cached()
            self.prefix_cache.snapshots.clear()
        return True

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return None if self.prefix_cache is None else self.prefix_cache.stats()

    # ---- scoring --------------------------------------------------------------------
    @torch.inference_mode()
    @_serialized
    def score(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [seq, vocab] of every position of one sequence of vocabulary ids, through
        the (chunked) prefill path, on blocks and slots of the engine's pools that it holds for
        the call."""
        self._check_open()
        ecfg = self.engine_config
        if len(ids) > ecfg.max_model_len:
            raise InputError(f"score: {len(ids)} tokens exceed max_model_len={ecfg.max_model_len}")
        chunk_len = min(ecfg.max_num_batched_tokens, len(ids))
        slots = self.slots.allocate() if self.kv_pools.can_hold(len(ids), chunk_len) else None
        if slots is None:
            raise InputError("score: the caches are full with running requests; call it when they finish")
        self._publish(Op("score", tuple(ids)))
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
