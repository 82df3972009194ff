"""benchmarks/step_breakdown.py (issue 32, item 2) in a short run: every phase of a verify step
is reported and was run, the phases add up to the step's measured wall time within the
wrappers' measured cost, and the product code is left as it was."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_breakdown as sb  # noqa: E402


def test_short_run_every_phase_reported_run_and_adding_up():
    originals = {(owner, attr): owner.__dict__[attr] for owner, attr, _ in sb._patches()}
    # 40 tokens: the timed run's prefill meets the prefix cache (a shorter graph than the first run's)
    b, = sb.measure([sb.Config("tiny-qwen3-next", 1, 1)], prompts=1, prompt_len=40, max_tokens=12, rounds=1,
                    verbose=False)
    assert sb.problems(b) == [], sb.problems(b)
    assert b.new_graphs == 0
    assert b.steps >= 3 and b.tokens_per_step >= 1
    # every phase is reported, and with num_spec 1 and a stop string each one ran but rejection
    # sampling and the sampling settings: a plain greedy step's outcome is computed inside the
    # verify graph
    assert set(b.phase_ms) == set(sb.PHASES) and set(sb.PHASES) - set(b.expected_phases()) == {"rejection", "sampling"}
    assert all(b.calls_per_step.get(p) for p in b.expected_phases() if p != sb.ROOT), b.calls_per_step
    assert all(b.phase_ms[p] > 0 for p in b.expected_phases()), b.phase_ms
    assert not b.calls_per_step.get("rejection") and b.phase_ms["rejection"] == 0
    assert not b.calls_per_step.get("sampling") and b.phase_ms["sampling"] == 0
    # the phases partition the step: they add up to its wall time within the wrappers' measured cost
    assert b.wrapper_us > 0 and b.overhead_ms > 0
    assert abs(sum(b.phase_ms.values()) - b.ms_per_step) <= b.overhead_ms
    assert abs(b.run_wall_s - b.accounted_s) <= b.wrapper_us * 1e-6 * b.run_calls
    assert 0 < b.graphs_ms < b.ms_per_step and not b.stray
    text = sb.report(b)
    assert all(p in text for p in sb.PHASES) and "check: phases reported" in text, text
    goal, = sb.goal_lines([b])
    assert goal.startswith("goal: host work <= 15% of a steady-state step at batch 1: tiny-qwen3-next num_spec 1: ")
    # the product's functions are back as they were
    assert {(owner, attr): owner.__dict__[attr] for owner, attr in originals} == originals

    # the check itself: a phase dropped from the report, or its time lost, is caught
    dropped = dataclasses.replace(b, phase_ms={p: t for p, t in b.phase_ms.items() if p != "rejection"})
    assert any("not reported" in m for m in sb.problems(dropped))
    lost = dataclasses.replace(b, phase_ms={**b.phase_ms, "verify graph": 0.0})
    assert any("add up" in m for m in sb.problems(lost))
    unrun = dataclasses.replace(b, calls_per_step={**b.calls_per_step, "detokenize": 0})
    assert any("never called" in m for m in sb.problems(unrun))


def test_a_graph_traced_in_the_timed_runs_is_a_fault():
    """One warm-up run leaves the prefix cache's shorter prefill to be traced in the timed run
    (what once put aot-tuned compiles into tiny-gemma4's prefill figure): reported as a fault."""
    b, = sb.measure([sb.Config("tiny-qwen3-next", 1, 1)], prompts=1, prompt_len=40, max_tokens=12, rounds=1,
                    verbose=False, warmups=1)
    assert b.new_graphs > 0 and any("during the timed runs" in m for m in sb.problems(b)), sb.problems(b)
