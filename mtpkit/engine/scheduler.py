"""Continuous batching: which requests run in the next step, and what their results mean.

A step is either PREFILL (ragged prompt chunks within a token budget; new requests are
admitted here, running ones keep decoding in the steps between) or VERIFY (every decoding
request feeds `bundle` tokens: uniform, so graph-shaped). When KV blocks run out the most
recently admitted request is preempted: its storage is freed and it is recomputed later from
its prompt plus what it has generated. No request is dropped or truncated silently. KV blocks
come from the pools of engine/kv_pools.py: a sliding pool's blocks below the window are
returned as the request advances (when its next step is scheduled).

The n samples of one prompt (SamplingParams.n) are admitted together: sample 0 holds the
seats and state slots of all of them and prefills the prompt up to its last token; then the
others fork from it (its blocks shared, reference-counted, its state copied into their
slots) and every sample prefills the last token itself, sampling its first token with its
own seed. Once forked, a sample is an ordinary request: preempted, it is recomputed from its
own prompt and outputs; aborted, the others go on. The copies a step needs (copy-on-write of
a shared block it writes into, forked state) travel in its plan and run before it.

Prefix caching (engine/prefix_cache.py): an admitted request (a recomputed one too) starts from
the longest cached prefix of its tokens that leaves at least one token to compute (the
sampler needs the last one's logits): its tables take the hit's blocks, and for a model with
recurrent state a restore of the boundary's snapshot into its slots is queued. After every
step the blocks below num_computed (accepted tokens only) are keyed. With recurrent state, a
prefill step writes state snapshots inside its chunks (StepPlan.snapshots: every
prefix_snapshot_interval tokens, the last full block before the prompt's last token and
where the prompt leaves the cached KV, no split chunk), and the state after a prefill that ends on a block boundary is saved; a verify
step whose accepted tokens cross a block boundary saves the state after the boundary's token
(its bundle slot).
"""

import collections
import dataclasses
import enum

from mtpkit.config import EngineConfig
from mtpkit.engine.allocators import SlotAllocator
from mtpkit.engine.kv_pools import KVPools
from mtpkit.engine.prefix_cache import PrefixCache, extend_keys
from mtpkit.engine.request import Request, Status
from mtpkit.step.cache import CacheCopies, StateSave
from mtpkit.text.stop_strings import Appended


class StepKind(enum.Enum):
    PREFILL = "prefill"
    VERIFY = "verify"


@dataclasses.dataclass
class StepPlan:
    kind: StepKind
    reqs: list[Request]
    chunk_lens: list[int]            # PREFILL: tokens of each request in this step
    num_reqs_padded: int             # VERIFY: graph size (== len(reqs) when eager)
    bundle: int
    # Done before the step runs (ModelRunner.execute): copy-on-write blocks, forked state;
    # `forked` the samples forked in this round (a step that raises recomputes them too).
    copies: CacheCopies = dataclasses.field(default_factory=CacheCopies)
    forked: list[Request] = dataclasses.field(default_factory=list)
    # PREFILL: recurrent-state snapshots the step writes, (row in reqs, position within that
    # row's chunk, snapshot id): the state after that token (step.metadata.StateSnapshots).
    snapshots: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # VERIFY without drafts (EngineConfig.num_scheduler_steps): decode steps run in a row, each
    # fed the last one's greedy tokens by the graph (ModelRunner._decode_run); every request emits that many.
    decode_steps: int = 1

    @property
    def num_reqs(self) -> int:
        return len(self.reqs)


@dataclasses.dataclass
class ReqResult:
    """What one step produced for one request."""

    emitted: list[int]               # new tokens (empty for a non-final prefill chunk)
    num_emitted: int                 # VERIFY: tokens of the bundle emitted (accepted drafts + 1)
    drafted: int                     # VERIFY: drafts that could have been accepted
    drafts: list[int]                # proposals for the next verify step
    error: str | None = None         # the request cannot go on (non-finite logits): it ends with this
    tokens_before_error: int = 0     # with error: how many of emitted are the request's before it ends
    logprobs: list | None = None     # params.logprobs: one {token: Logprob} per emitted token
    prompt_logprobs: list | None = None   # params.prompt_logprobs: the next prompt positions' dicts


class Scheduler:
    def __init__(self, ecfg: EngineConfig, pools: KVPools, slots: SlotAllocator, dispatch=None,
                 prefix: PrefixCache | None = None):
        self.cfg, self.pools, self.slots, self.prefix = ecfg, pools, slots, prefix
        self.dispatch = dispatch or (lambda n: n)   # num_reqs -> num_reqs_padded
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._last = StepKind.VERIFY
        self._copies, self._forked = CacheCopies(), []
        self.num_appended = 0   # output tokens the last update appended

    def add(self, req: Request) -> None:
        """Queue req (with its req.forks: the other samples of its prompt, not queued themselves)."""
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> list[Request]:
        """Every queued and running request, and the samples waiting to fork from them."""
        reqs = list(self.waiting) + list(self.running)
        return reqs + [f for r in reqs for f in r.forks]

    def _seats(self) -> int:
        """Running requests, counting the samples that will fork from them."""
        return len(self.running) + sum(len(r.forks) for r in self.running)

    # ---- scheduling -----------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        plan = self._schedule()
        if plan is not None and (self._copies or self._forked):   # (else the plan's own, empty)
            plan.copies, plan.forked = self._copies, self._forked
            self._copies, self._forked = CacheCopies(), []
        if plan is not None:
            if self.prefix is not None:   # the snapshots this plan's copies read and write are done with it
                self.prefix.snapshots.pinned.clear()
        return plan

    def _schedule(self) -> StepPlan | None:
        decoding = [r for r in self.running if not r.in_prefill]
        wants_prefill = any(r.in_prefill for r in self.running) or (
            self.waiting and self._seats() < self.cfg.max_num_seqs)
        # Alternate, so decoding requests keep moving while prompts are admitted.
        if wants_prefill and (not decoding or self._last == StepKind.VERIFY):
            plan = self._schedule_prefill()
            if plan is not None:
                self._last = StepKind.PREFILL
                return plan
            decoding = [r for r in self.running if not r.in_prefill]   # (a prefill that did not fit may preempt)
        if decoding:
            plan = self._schedule_verify(decoding)
            if plan is not None:
                self._last = StepKind.VERIFY
                return plan
        if self.running or self.waiting:
            plan = self._schedule_prefill()
            if plan is not None:
                self._last = StepKind.PREFILL
                return plan
            raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting request "
                               "(this is a bug: requests that can never fit are refused when added)")
        return None

    def _ensure_blocks(self, r: Request, positions: int) -> bool:
        """Blocks for r's next step, whose queries start at r.num_computed, up to `positions`
        (sliding pools first return what that step's window no longer reads)."""
        if not r.block_tables:
            r.block_tables = self.pools.new_tables()
        return self.pools.ensure(r.block_tables, r.num_computed, positions, self._copies.blocks)

    def _fork(self, r: Request) -> None:
        """r has prefilled its prompt up to the last token: the samples waiting on it start
        from there, on its blocks (shared) and a copy of its state (into the slots r held for
        them), and each prefills the last prompt token itself."""
        for f, slots in zip(r.forks, r.fork_slots):
            f.block_tables = self.pools.fork(r.block_tables)
            f.state_slots = slots
            if not self.slots.stateless:
                self._copies.slots.extend(zip(r.state_slots, slots))
            f.status, f.num_computed, f.prefill_target = Status.RUNNING, r.num_computed, f.num_tokens
            f.prev_num_emitted, f.drafts = 1, []
            f.block_keys, f.num_keyed, f.num_cached_tokens = list(r.block_keys), r.num_keyed, r.num_cached_tokens
            if r.prompt_logprobs is not None:   # the prompt's are computed once, by r
                f.prompt_logprobs = list(r.prompt_logprobs)
            self.running.append(f)
            self._forked.append(f)
        r.forks, r.fork_slots = [], []

    def _chunk(self, r: Request, budget: int) -> int:
        """Tokens of r's next prefill chunk: a sample others fork from stops before the last token."""
        end = r.fork_at if r.forks else r.prefill_target
        return min(end - r.num_computed, budget)

    # ---- prefix caching -------------------------------------------------------------
    def _lookup(self, r: Request) -> int | None:
        """Start r (tables empty, num_computed 0) from its longest cached prefix: tables over
        the hit's blocks, num_computed at its end. Returns the snapshot entry to restore
        (recurrent state), None when there is none."""
        r.num_keyed = 0
        if self.prefix is None:
            return None
        end = r.fork_at if r.forks else r.prefill_target
        if r.prompt_logprobs is not None:   # positions whose prompt logprobs are not known yet are computed
            end = min(end, len(r.prompt_logprobs))
        k, entries, snap, kv = self.prefix.match(self.prefix.keys(r), (end - 1) // self.cfg.block_size, self.pools)
        r.kv_match_end = kv * self.cfg.block_size
        if k:
            r.block_tables = self.pools.adopt(entries)
            r.num_keyed, r.num_computed = k, k * self.cfg.block_size
        return snap

    def _plan_snapshots(self, reqs: list[Request], lens: list[int]) -> list[tuple[int, int, int]]:
        """State snapshots a prefill step writes inside its chunks (recurrent state): after
        each multiple of the interval, the last full block before the prompt's last token and
        the end of the KV the cache held for the prompt (where the prompt left what earlier
        requests cached: the next request sharing that prefix resumes there), where the chunk
        passes them: (row, position within the chunk, snapshot entry)."""
        if self.prefix is None or not self.prefix.stateful:
            return []
        bs, every, out = self.cfg.block_size, self.prefix.snapshot_interval, []
        for i, (r, n) in enumerate(zip(reqs, lens)):
            start, end, last = r.num_computed, r.num_computed + n, (r.prefill_target - 1) // bs * bs
            bounds = set(range((start // every + 1) * every, end + 1, every))
            bounds |= {b for b in (last, r.kv_match_end) if start < b <= end}
            keys = self.prefix.keys(r)
            for b in sorted(bounds):
                if b < r.prefill_target and b // bs <= len(keys):
                    entry = self.prefix.snapshots.take(keys[b // bs - 1])
                    if entry is not None:
                        out.append((i, b - 1 - start, entry))
        return out

    def _admitted(self, r: Request, snap: int | None) -> None:
        """r was admitted from its lookup: the restore queued, the counters."""
        if self.prefix is None:
            return
        if snap is not None and r.num_computed:
            self.prefix.snapshots.use(snap)
            self._copies.restores.append((snap, list(r.state_slots)))
        c = self.prefix.counters
        c.queries, c.query_tokens, c.hit_tokens = c.queries + 1, c.query_tokens + r.prefill_target, \
            c.hit_tokens + r.num_computed
        if not r.num_preemptions:
            r.num_cached_tokens = r.num_computed

    def _key_blocks(self, r: Request, emitted: list[int], verify_start: int | None = None) -> None:
        """After a step: key r's blocks below num_computed (every position written by accepted
        tokens; `emitted` the step's tokens, not yet in r's outputs), and save state snapshots
        at the boundaries reached (a prefill chunk's end; in a verify step that began at
        `verify_start`, the last block boundary its accepted tokens crossed). Only the tokens
        from the first block not keyed yet are read: a step's host work does not grow with the
        sequence."""
        if self.prefix is None or not r.block_tables:
            return
        bs, keys = self.cfg.block_size, r.block_keys
        start = len(keys) * bs
        extend_keys(keys, r.tokens_from(start) + emitted, bs, self.prefix.lookahead, self.prefix.root, offset=start)
        hi = min(r.num_computed // bs, len(keys))
        if hi > r.num_keyed:
            self.pools.key(r.block_tables, keys, r.num_keyed, hi)
            r.num_keyed = hi
        if not self.prefix.stateful or not hi or not r.state_slots:
            return
        snaps = self.prefix.snapshots
        if verify_start is None:
            # a prefill that ends on a block's end (the boundaries inside its chunks were
            # written by the step: _plan_snapshots; this one's key needs the sampled token)
            pos = r.num_computed
            if pos % bs or r.in_prefill:
                return
            entry = snaps.take(keys[pos // bs - 1])
            if entry is not None:
                self._copies.saves.append(StateSave(tuple(r.state_slots), None, entry))
            return
        boundary = r.num_computed // bs * bs
        if boundary <= verify_start:
            return   # no block boundary crossed by this step's accepted tokens
        entry = snaps.take(keys[boundary // bs - 1])
        if entry is None:
            return
        self._copies.saves.append(StateSave(tuple(r.state_slots), boundary - 1 - verify_start, entry))
        # one decode snapshot per request is enough for the next turn: the one before goes,
        # unless it sits where a prefill would have saved one too
        if r.decode_snapshot is not None:
            snaps.drop(r.decode_snapshot)
        r.decode_snapshot = entry if boundary % self.prefix.snapshot_interval else None

    def _schedule_prefill(self) -> StepPlan | None:
        budget, reqs, lens = self.cfg.max_num_batched_tokens, [], []
        # The chunk that finishes a prompt is followed by the drafter's proposal, which writes
        # kv_lookahead positions past it.
        ahead = self.cfg.kv_lookahead
        for r in [r for r in self.running if r.forks and r.num_computed == r.fork_at]:
            self._fork(r)
        for r in [r for r in self.running if r.in_prefill]:
            n = self._chunk(r, budget)
            if n <= 0:
                break
            extra = ahead if r.num_computed + n == r.prefill_target else 0
            while not self._ensure_blocks(r, r.num_computed + n + extra):
                # Partly prefilled requests can hold the pool between them: make room by
                # preempting the newest one not already in this step (possibly r itself).
                victim = next((v for v in reversed(self.running) if v not in reqs), None)
                if victim is None:
                    break
                self._preempt(victim)
                if victim is r:
                    break
            if r.status != Status.RUNNING or not self._ensure_blocks(r, r.num_computed + n + extra):
                break
            reqs.append(r), lens.append(n)
            budget -= n
        while self.waiting and budget > 0 and self._seats() < self.cfg.max_num_seqs:
            r = self.waiting[0]
            # A prompt's n samples are admitted together: seats and state slots for all.
            if self._seats() + 1 + len(r.forks) > self.cfg.max_num_seqs:
                break
            slots = [self.slots.allocate() for _ in range(1 + len(r.forks))]
            if None in slots:
                for s in slots:
                    if s is not None:
                        self.slots.free(s)
                break
            target = r.num_tokens
            r.num_computed, r.prefill_target = 0, target
            snap = self._lookup(r)   # a prefix hit: tables over cached blocks, num_computed past them
            n = self._chunk(r, budget)
            extra = ahead if r.num_computed + n == target else 0
            # Admit only what the free pools can hold at the request's peak (prompt + the first
            # verify step; a sliding pool: its window and a step): admitting a chunk of a prompt
            # that cannot finish only starts a preemption cycle.
            if not self.pools.can_hold(target + self._verify_span, max(n + extra, self._verify_span),
                                       r.block_tables) or not self._ensure_blocks(r, r.num_computed + n + extra):
                self._release_blocks(r)
                r.prefill_target = r.num_computed = 0
                for s in slots:
                    self.slots.free(s)
                break
            self.waiting.popleft()
            r.status, r.state_slots, r.fork_slots = Status.RUNNING, slots[0], slots[1:]
            r.prefill_target, r.prev_num_emitted, r.drafts = target, 1, []
            self._admitted(r, snap)
            self.running.append(r)
            reqs.append(r), lens.append(n)
            budget -= n
        if not reqs:
            return None
        return StepPlan(StepKind.PREFILL, reqs, lens, len(reqs), self.cfg.bundle,
                        snapshots=self._plan_snapshots(reqs, lens))

    @property
    def _verify_span(self) -> int:
        return self.cfg.verify_span

    def _decode_steps(self, decoding: list[Request]) -> int:
        """Decode steps the next verify step of `decoding` runs in a row (num_scheduler_steps):
        1 unless every request is without controls, logprobs or a grammar, greedy or random (Request.plain:
        its tokens are a graph's outcome alone, which the run's graph feeds to its next step); at most what each request may still
        emit; with a prefix cache over recurrent state, ending at a request's next block boundary
        at the latest (only the last step's state is left to snapshot there: _key_blocks)."""
        steps = self.cfg.num_scheduler_steps
        if steps == 1 or not all(r.plain and r.grammar is None for r in decoding):
            return 1
        max_len, bs = self.cfg.max_model_len, self.cfg.block_size
        steps = min(steps, min(r.remaining(max_len) for r in decoding))
        if self.prefix is not None and self.prefix.stateful:
            steps = min(steps, min(bs - r.num_computed % bs for r in decoding))
        return max(steps, 1)

    def _schedule_verify(self, decoding: list[Request]) -> StepPlan | None:
        span = self._verify_span
        scheduled = []
        for r in decoding:
            if r.status != Status.RUNNING:
                continue  # preempted below while making room for an older request
            while not self._ensure_blocks(r, r.num_computed + span):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
            if r.status == Status.RUNNING:
                scheduled.append(r)
        if not scheduled:
            return None
        # A run of decode steps when the pools lend the blocks of all its steps now, else one
        # step: a run never preempts (a request alone would preempt itself over and over), and
        # every request has its one step's blocks before any asks for more.
        steps = self._decode_steps(scheduled)
        if steps > 1:
            ends = [r.num_computed + steps - 1 + span for r in scheduled]
            if self.pools.can_extend([(r.block_tables, r.num_computed, end) for r, end in zip(scheduled, ends)]):
                for r, end in zip(scheduled, ends):
                    held = self._ensure_blocks(r, end)
                    assert held, "the pools had the run's blocks free"
            else:
                steps = 1
        return StepPlan(StepKind.VERIFY, scheduled, [], self.dispatch(len(scheduled)), self.cfg.bundle,
                        decode_steps=steps)

    def _preempt(self, r: Request) -> None:
        self._release(r)
        r.status, r.num_computed, r.prefill_target, r.drafts, r.prev_num_emitted = Status.WAITING, 0, 0, [], 1
        r.num_preemptions += 1
        self.waiting.appendleft(r)

    def _release(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.controls is not None:   # its generation controls' slot (rebuilt from its tokens if it runs again)
            r.controls.release()
            r.controls = None
        self._release_blocks(r)
        # Detach before freeing: an interrupt between the two then leaks, never frees twice.
        slots, r.state_slots = r.state_slots, None
        forks, r.fork_slots = r.fork_slots, []
        if slots:
            # a copy into them not done yet (a sample forked in this round) is dropped
            self._copies.slots = [(a, b) for a, b in self._copies.slots if b not in slots]
            self.slots.free(slots)
        for s in forks:
            self.slots.free(s)

    def _release_blocks(self, r: Request) -> None:
        tables, r.block_tables = r.block_tables, []
        if tables:
            if self._copies.blocks:   # a copy into its blocks not done yet is dropped
                mine = {(k, b) for k, t in enumerate(tables) for b in t.held()}
                self._copies.blocks = [c for c in self._copies.blocks if (c[0], c[2]) not in mine]
            self.pools.release(tables)

    # ---- abort ----------------------------------------------------------------------
    def abort(self, reqs: list[Request]) -> list[Request]:
        """Finish the unfinished ones of reqs with "abort": out of waiting / running, their
        blocks and slots freed now. Returns those it aborted (finished ones are left alone)."""
        aborted = []
        for r in reqs:
            if r.status == Status.FINISHED:
                continue
            if r in self.waiting:
                self.waiting.remove(r)
            for owner in list(self.waiting) + self.running:
                if r in owner.forks:   # a sample not forked yet: the others go on without it
                    owner.forks.remove(r)
                    if owner.fork_slots:
                        self.slots.free(owner.fork_slots.pop())
            self.finish(r, "abort")
            aborted.append(r)
        return aborted

    def recompute(self, reqs: list[Request]) -> None:
        """A step that raised may have written its requests' KV and recurrent state without its
        results being applied; state slots are updated in place, so the step cannot simply run
        again. Its requests still running are preempted: recomputed from prompt + outputs."""
        for r in reversed(reqs):  # preemption queues at the front: keep their order
            if r.status == Status.RUNNING:
                self._preempt(r)

    # ---- results --------------------------------------------------------------------
    def update(self, plan: StepPlan, results: list[ReqResult]) -> list[Request]:
        """Apply a step's results; returns the requests that finished. `num_appended`: the output
        tokens it appended (what the step emitted, after stops)."""
        finished = []
        self.num_appended = 0
        for i, (r, res) in enumerate(zip(plan.reqs, results)):
            if r.status == Status.FINISHED:
                continue  # aborted while its step ran (a stream collected by gc mid-step)
            run = plan.decode_steps > 1
            before = len(r.output_token_ids)
            if res.error is not None:
                # The tokens before the position that failed (a dead end of the controls) are
                # the request's, as they would have been without drafts; then it ends.
                kept = res.emitted[:res.tokens_before_error]
                if not (kept and self._append(r, kept, plan.kind == StepKind.VERIFY, res.logprobs, run)):
                    r.error = res.error
                    self.finish(r, "error")
                if run:
                    r.stats.verify_steps += len(r.output_token_ids) - before
                finished.append(r)
                continue
            if plan.kind == StepKind.PREFILL:
                if res.prompt_logprobs:
                    r.prompt_logprobs.extend(res.prompt_logprobs)
                r.num_computed += plan.chunk_lens[i]
                self._key_blocks(r, res.emitted)
                if r.in_prefill:
                    continue
                r.prev_num_emitted = plan.bundle  # prefill leaves state as if the whole bundle was accepted
            elif run:   # one token per step, the last step's state in the one bundle slot
                r.num_computed += res.num_emitted
                self._key_blocks(r, res.emitted, r.num_computed - 1)
                r.prev_num_emitted = 1
            else:
                r.num_computed += res.num_emitted
                self._key_blocks(r, res.emitted, r.num_computed - res.num_emitted)
                r.prev_num_emitted = res.num_emitted
                r.stats.record(res.drafted, res.num_emitted - 1)
            r.drafts = res.drafts
            done = self._append(r, res.emitted, plan.kind == StepKind.VERIFY, res.logprobs, run)
            if run:   # a verify step per token kept (those after a stop were never steps one at a time)
                r.stats.verify_steps += len(r.output_token_ids) - before
            if done:
                finished.append(r)
        return finished

    def _append(self, r: Request, tokens: list[int], verify: bool, logprobs: list | None = None,
                step_each: bool = False) -> bool:
        """`step_each`: every token came from a step of its own (decode steps run in a row), else
        the tokens are one step's (a verify step's accepted drafts, then the target's token)."""
        p = r.params
        # A stop string may end inside the step's tokens (an accepted bundle): the tokens after
        # the one that completes it are dropped.
        stop_at = None
        if r.stop_matcher is not None and tokens:
            stop_at = r.stop_matcher.find(Appended(r.output_token_ids, tokens), len(tokens))
        if tokens:
            r.num_steps += 1
        for i, t in enumerate(tokens):
            r.output_token_ids.append(t)
            self.num_appended += 1
            if r.output_logprobs is not None:   # cut with the tokens: appended one by one
                r.output_logprobs.append(logprobs[i])
            if step_each and i:
                r.num_steps += 1
            r.token_steps.append(r.num_steps - 1)
            # A verify step emits its accepted drafts (positions 1..), then the target's token.
            r.token_draft_positions.append(i + 1 if verify and not step_each and i < len(tokens) - 1 else 0)
            if t in p.stop_token_ids or (not p.ignore_eos and t in r.eos_token_ids) or i == stop_at:
                return self.finish(r, "stop")
            if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.cfg.max_model_len:
                return self.finish(r, "length")
        return False

    def finish(self, r: Request, reason: str) -> bool:
        r.status, r.finish_reason = Status.FINISHED, reason
        self._release(r)
        if r.forks:
            # It ended before the others forked from it (aborted): the next sample takes its
            # place at the head of the queue and prefills the prompt for the rest.
            head, head.forks, head.fork_at = r.forks[0], r.forks[1:], r.fork_at
            r.forks = []
            self.waiting.appendleft(head)
        return True
