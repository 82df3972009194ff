"""Why a decode step's host work costs what it does (issue 32): the same host code timed after
the real graphs and after stand-ins that run no model.

A verify step's host work (scheduling, filling the buffers, reading the outcome back, the
bookkeeping, the stream's event) runs right after a graph replay that streamed the model's
weights (12.8 MB of float32 for tiny-qwen3-next) through the core's caches, evicting the Python
interpreter's and torch's code and data the host work then touches. This script times the host
work per verify step (a step's wall time, from one stream event to the next, less the time in
the graph replays) three ways, in one process and in rounds:

    graphs        the engine as it runs
    warm          each graph replaced by its recorded outputs (no model runs: the host's working
                  set stays in the caches; the tokens are then the recorded ones, the host work
                  per step the same)
    warm + sweep  the stand-ins plus a write over `--sweep-mb` MB (the graph's memory traffic
                  without its arithmetic): if the host work is back to the graphs' figure, the
                  difference is the caches

    python benchmarks/host_cold.py                                    # tiny-qwen3-next, num_spec 0, traced
    python benchmarks/host_cold.py --compile aot-tuned --num-spec 7 --draft-dtype bfloat16
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_cpu import heldout_prompts  # noqa: E402
from graph_clock import GraphClock, graphs_of, replace_graphs  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=0)
    p.add_argument("--compile", default="none", help="LLM(compile=...), or none (traced graphs)")
    p.add_argument("--draft-dtype", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--sweep-mb", type=float, default=16.0)
    args = p.parse_args()
    kw = {} if args.compile == "none" else dict(compile=args.compile, compile_after=0)
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=1, num_threads=1,
              draft_dtype=args.draft_dtype, **kw)
    g = llm.runner.graphs
    g.trace_after = 0
    prompts, sp = heldout_prompts(8, 64), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for _ in range(2):   # every graph these generations replay, traced (compiled)
        llm.generate(prompts, sp)

    real = graphs_of(g)
    clock = GraphClock()
    sweep = torch.zeros(int(args.sweep_mb * 2**20 / 4))
    recorded: dict = {}

    def stand_in(key, fn, swept: bool):
        def replay(*a):
            if key not in recorded:
                recorded[key] = fn(*a)
            out = recorded[key]
            if swept:
                sweep.add_(1.0)
            return tuple(x.clone() for x in out) if isinstance(out, tuple) else out.clone()
        return clock.timed(replay)

    modes = {"graphs": lambda k, f: clock.timed(f), "warm": lambda k, f: stand_in(k, f, False),
             "warm + sweep": lambda k, f: stand_in(k, f, True)}
    kinds = []
    schedule = llm.engine.scheduler.schedule

    def noted():
        plan = schedule()
        kinds.append(None if plan is None else plan.kind.value)
        return plan
    llm.engine.scheduler.schedule = noted

    def run() -> list[float]:
        """Host microseconds of each verify step: its cycle (event to event) less its graphs."""
        host = []
        for q in prompts:
            kinds.clear()
            t, before = time.perf_counter(), clock.seconds
            for _ in llm.stream([q], sp):
                now = time.perf_counter()
                if kinds and kinds[-1] == "verify":
                    host.append((now - t - (clock.seconds - before)) * 1e6)
                t, before = now, clock.seconds
        return host

    results = {m: [] for m in modes}
    for r in range(args.rounds + 1):   # round 0: the stand-ins' own warm-up (their outputs recorded)
        for mode, wrap in modes.items():
            replace_graphs(g, real, wrap)
            host = run()
            if r:
                results[mode].append(statistics.median(host))
    print(f"host work per verify step (median us; the step's cycle less its graph replays), {args.model} "
          f"num_spec {args.num_spec}, compile {args.compile}, drafter dtype {args.draft_dtype or 'as the target'}, "
          f"8 held-out prompts x {args.max_tokens} tokens at batch 1, one thread, {args.rounds} rounds:")
    base = statistics.median(results["graphs"])
    for mode, vals in results.items():
        m = statistics.median(vals)
        print(f"  {mode:14s} {m:7.1f} us  (x{m / base:.2f} of after the graphs; rounds {', '.join(f'{v:.1f}' for v in vals)})")


if __name__ == "__main__":
    main()
