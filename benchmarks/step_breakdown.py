"""Where a steady-state CPU decode / verify step's time goes (issue 32, item 2): inside the
captured bodies (the traced verify and propose graphs) versus the host work around them, by
phase. The measurement only: the product code is unchanged. The script wraps the functions
that make up a step with time.perf_counter accumulators (monkeypatched here, restored after)
and attributes the time between any two wrapper events to the innermost phase running, so the
phases are exclusive times that partition the step's wall time:

    verify graph     the traced verify body's replay (target forward + logits at every bundle position + the
                     greedy outcome: argmax, accepted drafts, finite check, sampling/rejection.greedy_verify)
    propose graph    the traced propose body's replay (the drafter's proposal)
    schedule         Scheduler.schedule
    metadata         CapturedSteps.verify / .propose outside their graph calls: StaticBuffers.fill (the
                     rows written into the static buffers) and the proposal's copies of what was emitted
    sampling         ModelRunner._sampling, SamplingTensors.from_params (not run by greedy steps without
                     controls or logprobs: Request.plain_greedy)
    rejection        rejection_sample: not run by these greedy steps, whose outcome the verify graph computes
                     (ModelRunner.greedy_in_step); it runs for sampled or controlled steps
    step glue        Engine.advance / Engine.step, ModelRunner.execute / _verify outside the phases above: the
                     UniformRows, the draft limits, the outcome's .tolist(), the ReqResults
    bookkeeping      Scheduler.update and _append outside the stop checks
    stop checks      StopStringMatcher.find (in _append), first_stop / partial_stop_len (in the
                     detokenizer), cut_at_stop (where an output is built)
    detokenize       IncrementalDetokenizer.add outside its stop checks
    outputs          LLM._state (what each event keeps of its prompt's samples) and _PromptState.build
                     outside cut_at_stop (a RequestOutput: its list copies; built when an event's
                     output is read, by generate() where a sample finished)
    stream           the rest of LLM.stream (and this script's empty loop over its events)

A step runs from one LLM.step call to the next (the stream's handling of a step's events
belongs to that step). Only verify steps are reported; prefill steps and each generation's
set-up (validation, queueing) are counted and left out. The steady state: CPU graphs traced on
first use (`llm.runner.graphs.trace_after = 0`), two warm-up runs of the very same generations
(so every graph key is traced, or compiled, before timing: the second meets the prefix cache as
the timed runs do, whose prefills of a cached prompt are shorter graphs; a graph traced or
compiled during the timed runs is reported as a fault), one intra-op thread, greedy,
`ignore_eos`, and by default one stop string that never occurs (so the stop checks run, as for a chat request; `--no-stop` drops it). The engines are
timed in rounds, each round running every configuration once, so a noisy stretch of the shared
machine hits every configuration alike.

The wrappers add a little time of their own, inside the phases: the script measures one
wrapped call's cost on a no-op and prints it with the calls per step, and checks that the
phases add up to the step's wall time within that cost.

    python benchmarks/step_breakdown.py                                   # both families, batch 1 and 8, num_spec 0 and 3
    python benchmarks/step_breakdown.py --models tiny-gemma4 --batches 1 --specs 3
    python benchmarks/step_breakdown.py --profile --model tiny-qwen3-next --batch 1 --num-spec 3   # cProfile
"""

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import functools
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # training/ (the held-out prompts)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu import heldout_prompts  # noqa: E402

import mtpkit.llm as llm_module  # noqa: E402
import mtpkit.engine.runner as runner_module  # noqa: E402
from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.engine.args import COMPILE_MODES  # noqa: E402
from mtpkit.engine.engine import Engine  # noqa: E402
from mtpkit.engine.runner import ModelRunner  # noqa: E402
from mtpkit.engine.scheduler import Scheduler  # noqa: E402
from mtpkit.graphs.captured import CapturedSteps  # noqa: E402
from mtpkit.sampling.sampler import SamplingTensors  # noqa: E402
from mtpkit.text import stop_strings  # noqa: E402
from mtpkit.text.detokenize import IncrementalDetokenizer  # noqa: E402
from mtpkit.text.stop_strings import StopStringMatcher  # noqa: E402

GRAPH_PHASES = ("verify graph", "propose graph")
HOST_PHASES = ("schedule", "metadata", "sampling", "rejection", "step glue", "bookkeeping", "stop checks",
               "detokenize", "outputs", "stream")
PHASES = GRAPH_PHASES + HOST_PHASES          # every phase of a verify step, in the table's order
ROOT = "stream"                               # what runs when no wrapped function does
NEVER_STOP = "\u2603\u2603 never \u2603\u2603"   # a stop string the embedded models never write
GOAL = 0.15                                   # issue 32: host work <= 15% of a steady-state step at batch 1


# ---- the clock ----------------------------------------------------------------------------
@dataclasses.dataclass
class StepRecord:
    """One step's exclusive time per phase (or a generation's set-up before its first step)."""

    kind: str                                  # "setup", "prefill", "verify" (or "empty": no plan)
    start: float
    end: float = 0.0
    num_reqs: int = 0
    tokens: int = 0                            # tokens the stream reported after this step
    phases: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def wall(self) -> float:
        return self.end - self.start


class Clock:
    """A stack of the wrapped functions running now; the time between two events (a wrapped
    call's entry or exit, a step boundary) goes to the innermost one's phase of the current
    step's record."""

    def __init__(self):
        self.active = False
        self.records: list[StepRecord] = []
        self.rec: StepRecord | None = None
        self.stack: list[str] = []
        self.last = 0.0

    def _tick(self) -> float:
        now = time.perf_counter()
        self.rec.phases[self.stack[-1]] += now - self.last
        self.last = now
        return now

    def enter(self, phase: str) -> None:
        self._tick()
        self.stack.append(phase)
        self.rec.calls[phase] += 1

    def exit(self) -> None:
        self._tick()
        self.stack.pop()

    def begin(self, records: list[StepRecord]) -> None:
        """Start timing a generation: its set-up record is open, the stream is the root phase."""
        self.records, self.stack, self.active = records, [ROOT], True
        self.last = time.perf_counter()
        self.rec = StepRecord("setup", self.last)
        records.append(self.rec)

    def boundary(self) -> None:
        """A step begins (LLM.step was called): close the current record, open the step's."""
        assert self.stack == [ROOT], f"LLM.step called inside {self.stack}"
        now = self._tick()
        self.rec.end = now
        self.rec = StepRecord("empty", now)
        self.records.append(self.rec)

    def end(self) -> None:
        self.rec.end = self._tick()
        self.active = False


CLOCK = Clock()


def timed(fn, phase: str, after=None):
    """fn, timed as `phase` while the clock runs; `after(result)` sees what it returned."""
    @functools.wraps(fn)
    def timed_call(*args, **kwargs):
        if not CLOCK.active:
            return fn(*args, **kwargs)
        CLOCK.enter(phase)
        try:
            result = fn(*args, **kwargs)
        finally:
            CLOCK.exit()
        if after is not None:
            after(result)
        return result
    return timed_call


def _step_boundary(fn):
    @functools.wraps(fn)
    def step_call(self):
        if not CLOCK.active:
            return fn(self)
        CLOCK.boundary()
        CLOCK.enter("step glue")
        try:
            return fn(self)
        finally:
            CLOCK.exit()
    return step_call


def _planned(plan) -> None:
    if plan is not None:
        CLOCK.rec.kind, CLOCK.rec.num_reqs = plan.kind.value, plan.num_reqs


def _graph_phase(name: str) -> str:
    # graphs/captured.py names its traces verify_{n}_{context}, propose_..., prefill_proposal_...
    # decode_{n}_{context}: the verify body that advances its own inputs (decode runs, num_scheduler_steps)
    return {"verify": "verify graph", "decode": "verify graph", "propose": "propose graph"}.get(
        name.split("_")[0], "prefill proposal graph")


def _traced(trace):
    """CapturedSteps._trace whose traced function is timed as its graph phase. A trace made while
    the clock runs is timed as "tracing" (a phase no steady-state step should have)."""
    @functools.wraps(trace)
    def trace_call(self, fn, args, name):
        graph, phase = timed(trace, "tracing")(self, fn, args, name), _graph_phase(name)

        def replay_graph(*a):   # a named frame: cProfile (--profile) shows the graphs' time under it
            if not CLOCK.active:
                return graph(*a)
            CLOCK.enter(phase)
            try:
                return graph(*a)
            finally:
                CLOCK.exit()
        return replay_graph
    return trace_call


def _patches(graphs_only: bool = False) -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) of every instrumented function."""
    out = [(CapturedSteps, "_trace", _traced(CapturedSteps._trace))]
    if graphs_only:
        return out
    # A call's stream steps through Engine.advance (engine/loop.py), LLM.step through Engine.step.
    out += [(Engine, name, _step_boundary(getattr(Engine, name))) for name in ("advance", "step")]
    out.append((Scheduler, "schedule", timed(Scheduler.schedule, "schedule", after=_planned)))
    for owner, attr, phase in [
        (CapturedSteps, "verify", "metadata"), (CapturedSteps, "propose", "metadata"),
        (CapturedSteps, "decode", "metadata"),                 # a run's fill and its advances between replays
        (ModelRunner, "_sampling", "sampling"),
        (runner_module, "rejection_sample", "rejection"),     # the name the runner calls
        (Scheduler, "update", "bookkeeping"), (Scheduler, "_append", "bookkeeping"),
        (StopStringMatcher, "find", "stop checks"),
        (stop_strings, "first_stop", "stop checks"), (stop_strings, "partial_stop_len", "stop checks"),
        (llm_module, "cut_at_stop", "stop checks"),           # the name _SampleState.completion calls
        (IncrementalDetokenizer, "add", "detokenize"),
        (llm_module.LLM, "_state", "outputs"), (llm_module._PromptState, "build", "outputs"),
    ]:
        out.append((owner, attr, timed(getattr(owner, attr), phase)))
    from_params = SamplingTensors.__dict__["from_params"].__func__
    out.append((SamplingTensors, "from_params", classmethod(timed(from_params, "sampling"))))
    return out


@contextlib.contextmanager
def instrument(graphs_only: bool = False):
    """The wrappers installed; the originals restored on exit. Graphs traced inside keep their
    timed replay (it runs untimed when the clock is off). `graphs_only`: only the graphs' replay
    (for --profile, where cProfile does the rest)."""
    saved = []
    try:
        for owner, attr, new in _patches(graphs_only):
            saved.append((owner, attr, owner.__dict__[attr]))
            setattr(owner, attr, new)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)


def wrapper_cost(calls: int = 100_000, repeats: int = 5) -> float:
    """Seconds one wrapped call adds: a wrapped no-op against the bare one, median of `repeats`."""
    def noop():
        return None
    wrapped = timed(noop, "overhead")
    costs = []
    for _ in range(repeats):
        CLOCK.begin([])
        t = time.perf_counter()
        for _ in range(calls):
            noop()
        bare = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(calls):
            wrapped()
        costs.append((time.perf_counter() - t - bare) / calls)
        CLOCK.end()
    return max(statistics.median(costs), 0.0)


# ---- one configuration ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    batch: int
    num_spec: int
    compile: str | None = None      # LLM(compile=...): the graphs compiled (in the warm-up), else traced
    steps: int = 1                  # LLM(num_scheduler_steps=...): decode steps per scheduling (num_spec 0)

    def __str__(self) -> str:
        return (f"{self.model} batch {self.batch} num_spec {self.num_spec}" + (f" {self.compile}" if self.compile else "")
                + (f" {self.steps} steps" if self.steps > 1 else ""))


@dataclasses.dataclass
class Breakdown:
    """A configuration's verify steps, averaged over every timed round."""

    config: Config
    steps: int                      # verify steps timed
    ms_per_step: float              # their mean wall time (from the step boundaries)
    phase_ms: dict                  # phase -> mean ms per verify step (every phase of PHASES)
    calls_per_step: dict            # phase -> mean wrapped calls per verify step
    tokens_per_step: float
    rows_per_step: float
    wrapper_us: float               # one wrapped call's cost (wrapper_cost)
    prefill_steps: int
    prefill_ms: float               # mean prefill step (left out of the breakdown)
    setup_ms: float                 # mean set-up per generation (left out)
    run_wall_s: float               # this script's own perf_counter over the timed runs
    accounted_s: float              # every record's phases (set-up, prefill, verify) over the same runs
    run_calls: int                  # wrapped calls over the same runs
    stray: dict                     # phase -> ms per verify step of phases outside PHASES ("tracing", ...)
    has_stop: bool
    new_graphs: int = 0             # graphs traced or compiled during the timed runs (a fault)

    @property
    def graphs_ms(self) -> float:
        return sum(self.phase_ms[p] for p in GRAPH_PHASES)

    @property
    def host_ms(self) -> float:
        return sum(self.phase_ms[p] for p in HOST_PHASES)

    def share(self, phase: str) -> float:
        return self.phase_ms[phase] / self.ms_per_step

    @property
    def host_share(self) -> float:
        return self.host_ms / self.ms_per_step

    @property
    def overhead_ms(self) -> float:
        """The wrappers' estimated cost per verify step (inside the phases above)."""
        return self.wrapper_us * sum(self.calls_per_step.values()) / 1e3

    def expected_phases(self) -> tuple[str, ...]:
        """The phases every verify step of this configuration must run."""
        skip = set()
        if self.config.num_spec == 0:
            skip.add("propose graph")
        if not self.has_stop:
            skip.add("stop checks")
        # greedy steps without controls or logprobs: their outcome is the verify graph's, and no
        # sampling settings are built (ModelRunner.greedy_in_step, Request.plain_greedy)
        skip.update(("rejection", "sampling"))
        return tuple(p for p in PHASES if p not in skip)


def build(config: Config, max_num_seqs: int) -> LLM:
    kw = {} if config.compile is None else dict(compile=config.compile, compile_after=0)
    llm = LLM(config.model, num_spec=config.num_spec, dtype="float32", max_num_seqs=max_num_seqs, num_threads=1,
              num_scheduler_steps=config.steps, **kw)
    llm.runner.graphs.trace_after = 0   # long-lived engine: CPU graphs traced (and compiled) on first use
    return llm


def graph_count(llm: LLM) -> int:
    """The engine's graphs traced so far, and compiled (a compiled graph keeps its trace's key)."""
    g = llm.runner.graphs
    traced = sum(len(d) for d in (g.verify_graphs, g.decode_graphs, g.propose_graphs, g.prefill_graphs, g.prefill_proposal_graphs,
                                  g.control_graphs, g.sample_graphs))
    return traced + (len(g.compiler.records) if g.compiler is not None else 0)


def run(llm: LLM, groups: list, sp: SamplingParams, records: list[StepRecord] | None) -> float:
    """Every group of prompts through LLM.stream (one stream per group), timed into `records`
    (None: untimed); returns this function's own wall time over the streams."""
    t0 = time.perf_counter()
    for g in groups:
        if records is not None:
            CLOCK.begin(records)
        for ev in llm.stream(g, sp):
            if records is not None:
                CLOCK.rec.tokens += len(ev.new_token_ids)
        if records is not None:
            CLOCK.end()
    return time.perf_counter() - t0


def summarize(config: Config, records: list[StepRecord], run_wall: float, wrapper_us: float,
              has_stop: bool, phases=PHASES) -> Breakdown:
    """The verify steps of `records` averaged (`phases`: those the report lists)."""
    verify = [r for r in records if r.kind == "verify"]
    prefill = [r for r in records if r.kind == "prefill"]
    setup = [r for r in records if r.kind == "setup"]
    n = len(verify)
    if not n:
        raise SystemExit(f"{config}: no verify step was timed; raise --max-tokens")
    totals, calls = collections.Counter(), collections.Counter()
    for r in verify:
        totals.update(r.phases), calls.update(r.calls)
    return Breakdown(
        config=config, steps=n, ms_per_step=sum(r.wall for r in verify) / n * 1e3,
        phase_ms={p: totals[p] / n * 1e3 for p in phases},
        calls_per_step={p: calls[p] / n for p in calls},
        tokens_per_step=sum(r.tokens for r in verify) / n, rows_per_step=sum(r.num_reqs for r in verify) / n,
        wrapper_us=wrapper_us * 1e6, prefill_steps=len(prefill),
        prefill_ms=sum(r.wall for r in prefill) / max(len(prefill), 1) * 1e3,
        setup_ms=sum(r.wall for r in setup) / max(len(setup), 1) * 1e3,
        run_wall_s=run_wall, accounted_s=sum(sum(r.phases.values()) for r in records),
        run_calls=sum(sum(r.calls.values()) for r in records),
        stray={p: t / n * 1e3 for p, t in totals.items() if p not in PHASES}, has_stop=has_stop)


def problems(b: Breakdown) -> list[str]:
    """What is wrong with a breakdown: a phase not reported or never run, phases that do not add
    up to the step's wall time within the wrappers' measured cost, time in no reported phase."""
    out = []
    missing = [p for p in PHASES if p not in b.phase_ms]
    if missing:
        out.append(f"phases not reported: {missing}")
    # the root phase is entered by no call: it must have time
    idle = [p for p in b.expected_phases() if not (b.calls_per_step.get(p) or (p == ROOT and b.phase_ms.get(p)))]
    if idle:
        out.append(f"phases never called (is the wrapper on the function the engine calls?): {idle}")
    gap = abs(sum(b.phase_ms.values()) - b.ms_per_step)
    if gap > b.overhead_ms:
        out.append(f"the phases add up to {sum(b.phase_ms.values()):.4f} ms, the step takes {b.ms_per_step:.4f} ms: "
                   f"{gap * 1e3:.2f} us apart, more than the wrappers' {b.overhead_ms * 1e3:.2f} us per step")
    # over the whole run, this script's own clock (set-up and prefill steps included)
    if abs(b.run_wall_s - b.accounted_s) > b.wrapper_us * 1e-6 * b.run_calls:
        out.append(f"the records account for {b.accounted_s:.6f} s of a {b.run_wall_s:.6f} s run")
    if b.new_graphs:
        out.append(f"{b.new_graphs} graphs were traced or compiled during the timed runs (the warm-up missed their keys)")
    if any(b.stray.values()):
        out.append(f"verify steps spent time outside the reported phases: "
                   + ", ".join(f"{p} {ms:.3f} ms/step" for p, ms in b.stray.items()))
    return out


def measure(configs: list[Config], *, prompts: int, prompt_len: int, max_tokens: int, rounds: int,
            stop: bool = True, verbose: bool = True, warmups: int = 2) -> list[Breakdown]:
    """Each configuration's breakdown: engines built and warmed up (their graphs traced) inside
    `instrument()`, then `rounds` rounds each running every configuration once."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=[NEVER_STOP] if stop else [])
    ids = heldout_prompts(max(prompts, *(c.batch for c in configs)), prompt_len)
    with instrument():
        cost = wrapper_cost()
        engines, groups, records, walls = {}, {}, {}, {}
        for c in configs:
            engines[c] = build(c, max(c.batch for c in configs))
            mine = ids[:max(prompts, c.batch)]   # at least one full batch
            groups[c] = [mine[i:i + c.batch] for i in range(0, len(mine), c.batch)]
            for _ in range(warmups):   # warm-up: every graph key traced; the second run's prefills meet the prefix cache
                run(engines[c], groups[c], sp, None)
            records[c], walls[c] = [], 0.0
            if verbose:
                print(f"  built and warmed up: {c}", flush=True)
        before = {c: graph_count(engines[c]) for c in configs}
        for _ in range(rounds):
            for c in configs:
                walls[c] += run(engines[c], groups[c], sp, records[c])
        out = [dataclasses.replace(summarize(c, records[c], walls[c], cost, stop),
                                   new_graphs=graph_count(engines[c]) - before[c]) for c in configs]
        for llm in engines.values():
            llm.close()
    return out


# ---- reporting ----------------------------------------------------------------------------
SHORT = {"verify graph": "verify g", "propose graph": "propose g", "step glue": "glue", "bookkeeping": "bookkeep",
         "stop checks": "stop", "detokenize": "detok"}


def report(b: Breakdown) -> str:
    c = b.config
    lines = [f"{c}: {b.ms_per_step:.3f} ms per verify step ({b.steps} steps, {b.rows_per_step:.2f} requests and "
             f"{b.tokens_per_step:.2f} tokens per step: {b.ms_per_step / b.tokens_per_step:.3f} ms per token; left out: "
             f"{b.prefill_steps} prefill steps of {b.prefill_ms:.2f} ms, set-up {b.setup_ms:.2f} ms per generation)",
             f"  graphs {100 * b.graphs_ms / b.ms_per_step:.1f}% ("
             + ", ".join(f"{p} {100 * b.share(p):.1f}%" for p in GRAPH_PHASES) + f"), host {100 * b.host_share:.1f}% = "
             + " + ".join(f"{p} {100 * b.share(p):.1f}%" for p in HOST_PHASES),
             f"  ms per step: " + ", ".join(f"{p} {b.phase_ms[p]:.4f}" for p in PHASES),
             f"  wrapped calls per step: {sum(b.calls_per_step.values()):.1f} at {b.wrapper_us:.2f} us each = "
             f"{b.overhead_ms * 1e3:.1f} us ({100 * b.overhead_ms / b.ms_per_step:.1f}% of the step, inside the "
             f"phases above; host share without it {100 * (b.host_ms - b.overhead_ms) / (b.ms_per_step - b.overhead_ms):.1f}%)"]
    bad = problems(b)
    lines.append("  check: " + ("phases reported, run, and adding up to the step within the wrappers' cost"
                                if not bad else "FAILED: " + "; ".join(bad)))
    return "\n".join(lines)


def table(results: list[Breakdown]) -> str:
    head = ["model", "batch", "k", "ms/step", "tok/step", "graphs"] + [SHORT.get(p, p) for p in HOST_PHASES] + ["host"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in results:
        c = b.config
        cells = [c.model + (f" {c.compile}" if c.compile else ""), str(c.batch), str(c.num_spec), f"{b.ms_per_step:.3f}", f"{b.tokens_per_step:.2f}",
                 f"{100 * b.graphs_ms / b.ms_per_step:.1f}%"] + [f"{100 * b.share(p):.1f}" for p in HOST_PHASES] + [
                     f"**{100 * b.host_share:.1f}%**"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def goal_lines(results: list[Breakdown]) -> list[str]:
    out = []
    for b in results:
        if b.config.batch != 1:
            continue
        met = "met" if b.host_share <= GOAL else "not met"
        nostop = (b.host_ms - b.phase_ms["stop checks"]) / (b.ms_per_step - b.phase_ms["stop checks"])
        out.append(f"goal: host work <= {100 * GOAL:.0f}% of a steady-state step at batch 1: {b.config.model}"
                   f"{' ' + b.config.compile if b.config.compile else ''} "
                   f"num_spec {b.config.num_spec}: {100 * b.host_share:.1f}% ({met}; without the stop-string checks "
                   f"{100 * nostop:.1f}%)")
    return out


# ---- --profile --------------------------------------------------------------------------------
def _where(key) -> str:
    file, line, name = key
    if file == "~":
        return name
    root = str(Path(__file__).resolve().parents[1]) + os.sep
    for prefix in (root, *(p + os.sep for p in sys.path if p.endswith("site-packages"))):
        if file.startswith(prefix):
            file = file[len(prefix):]
            break
    return f"{file}:{line}({name})"


class VerifyStepProfiler:
    """cProfile switched on for verify steps only: on when Scheduler.schedule returns a verify
    plan, off when the next step begins (Engine._step, which LLM.step and a stream's
    Engine.advance both run) or a stream ends; so a verify step's profile holds everything after
    its schedule call, the stream's handling of its events included."""

    def __init__(self):
        self.prof, self.on, self.steps, self.seconds, self.since = cProfile.Profile(), False, 0, 0.0, 0.0

    def start(self) -> None:
        self.steps += 1
        self.on, self.since = True, time.perf_counter()
        self.prof.enable()

    def stop(self) -> None:
        if self.on:
            self.prof.disable()
            self.seconds += time.perf_counter() - self.since
            self.on = False

    def patches(self) -> list[tuple[object, str, object]]:
        step, schedule = Engine.__dict__["_step"], Scheduler.schedule

        def step_call(engine):
            self.stop()
            return step(engine)

        def schedule_call(sched):
            plan = schedule(sched)
            if plan is not None and plan.kind.value == "verify":
                self.start()
            return plan
        return [(Engine, "_step", step_call), (Scheduler, "schedule", schedule_call)]


def profile(config: Config, *, prompts: int, prompt_len: int, max_tokens: int, rounds: int, top: int,
            stop: bool = True) -> None:
    """cProfile over the verify steps of `rounds` runs of one configuration after a warm-up (the
    graphs' replay shows as replay_graph; the schedule call itself is not profiled). Prints the
    top host functions by cumulative and by own time."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=[NEVER_STOP] if stop else [])
    ids = heldout_prompts(max(prompts, config.batch), prompt_len)   # at least one full batch
    groups = [ids[i:i + config.batch] for i in range(0, len(ids), config.batch)]
    vp = VerifyStepProfiler()
    with instrument(graphs_only=True):
        llm = build(config, config.batch)
        for _ in range(2):   # as measure(): the second run's prefills meet the prefix cache
            run(llm, groups, sp, None)
        saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in vp.patches()]
        try:
            for owner, attr, new in vp.patches():
                setattr(owner, attr, new)
            for _ in range(rounds):
                for g in groups:
                    for _ev in llm.stream(g, sp):
                        pass
                    vp.stop()
        finally:
            for owner, attr, old in saved:
                setattr(owner, attr, old)
        llm.close()
    stats = pstats.Stats(vp.prof).stats     # key -> (primitive calls, calls, own time, cumulative, callers)
    steps, total = vp.steps, vp.seconds
    graphs = sum(v[3] for k, v in stats.items() if k[2] == "replay_graph")
    print(f"cProfile, {config}: {rounds} runs of {len(ids)} prompts x {max_tokens} tokens, {steps} verify steps "
          f"profiled: {total / steps * 1e3:.3f} ms per step under the profiler, of which the graphs (replay_graph) "
          f"{100 * graphs / total:.1f}%. cProfile's own cost per Python call inflates the host functions: read the "
          "ranks, not the absolute times. Frames entered before a step's profile began (LLM.stream, LLM.step's "
          "callers) are missing or partial.")
    mine = str(Path(__file__).resolve())
    host = {k: v for k, v in stats.items() if k[2] != "replay_graph" and k[0] != mine and "Profile" not in k[2]
            and "disable" not in k[2]}
    for title, col in (("cumulative", 3), ("own", 2)):
        print(f"\ntop {top} host functions by {title} time (per verify step; % of the profiled time):")
        print(f"  {'cum us':>8} {'own us':>8} {'calls':>7} {'%':>6}  function")
        for k, v in sorted(host.items(), key=lambda kv: -kv[1][col])[:top]:
            print(f"  {v[3] / steps * 1e6:>8.1f} {v[2] / steps * 1e6:>8.1f} {v[1] / steps:>7.2f} "
                  f"{100 * v[col] / total:>5.1f}%  {_where(k)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny-qwen3-next", "tiny-gemma4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--specs", type=int, nargs="+", default=[0, 3])
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per run, `batch` at a time")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", choices=COMPILE_MODES, nargs="+", default=[],
                   help="also these LLM(compile=...) modes: each configuration once traced and once per mode "
                        "(graphs compiled in the warm-up; aot packages come from their cache when warm)")
    p.add_argument("--scheduler-steps", type=int, nargs="+", default=[1],
                   help="LLM(num_scheduler_steps=...) values: num_spec 0 configurations once per value (a step "
                        "then runs up to that many decode steps in a row)")
    p.add_argument("--no-stop", action="store_true", help="no stop string (the stop checks do not run)")
    p.add_argument("--profile", action="store_true", help="cProfile one configuration instead")
    p.add_argument("--model", default="tiny-qwen3-next", help="--profile: the model")
    p.add_argument("--batch", type=int, default=1, help="--profile: the batch")
    p.add_argument("--num-spec", type=int, default=3, help="--profile: num_spec")
    p.add_argument("--top", type=int, default=25, help="--profile: functions listed")
    args = p.parse_args(argv)
    stop = not args.no_stop
    if args.profile:
        profile(Config(args.model, args.batch, args.num_spec, (args.compile or [None])[0],
                       args.scheduler_steps[0] if args.num_spec == 0 else 1), prompts=args.prompts, prompt_len=args.prompt_len,
                max_tokens=args.max_tokens, rounds=args.rounds, top=args.top, stop=stop)
        return 0
    configs = [Config(m, b, k, mode, n) for m in args.models for b in args.batches for k in args.specs
               for mode in [None, *args.compile] for n in (args.scheduler_steps if k == 0 else [1])]
    print(f"step breakdown: {args.prompts} held-out prompts of {args.prompt_len} tokens x {args.max_tokens} tokens "
          f"per run, greedy, float32, 1 thread, stop string {'on (never matches)' if stop else 'off'}; "
          f"{args.rounds} timed rounds after a warm-up, each running every configuration once")
    results = measure(configs, prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                      rounds=args.rounds, stop=stop)
    print()
    for b in results:
        print(report(b))
    print("\nshares of a verify step, % (graphs: the verify and propose graphs' replay; host: the phases after):")
    print(table(results))
    print()
    for line in goal_lines(results):
        print(line)
    bad = [b for b in results if problems(b)]
    print(f"\nchecks: {len(results) - len(bad)}/{len(results)} configurations' phases reported, run and adding up")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
