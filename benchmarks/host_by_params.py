"""A verify step's host work by what the requests ask (issue 32): greedy (whose outcome the verify
graph computes), seeded sampling (the sample graph's), greedy with a generation control (the
controls graph's), and sampling with top-k, top-p and a penalty (the controls graph, then the
sample graph). Per step: its cycle (one stream
event to the next) less its graph replays, median over the steps after each generation's first;
CPU graphs traced (or compiled) in two warm-up runs of the same generations.

    python benchmarks/host_by_params.py                                   # tiny-qwen3-next, num_spec 3, traced
    python benchmarks/host_by_params.py --compile aot-tuned --num-spec 7 --draft-dtype bfloat16
    python benchmarks/host_by_params.py --compile aot-tuned --num-spec 0 --scheduler-steps 8   # decode runs

With --scheduler-steps N (num_spec 0: LLM(num_scheduler_steps=N)) a step is a run of up to N
decode steps (for the requests without controls); the table adds its tokens and the host per token.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_cpu import heldout_prompts  # noqa: E402
from graph_clock import GraphClock, graphs_of, replace_graphs  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--compile", default="none", help="LLM(compile=...), or none (traced graphs)")
    p.add_argument("--draft-dtype", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--scheduler-steps", type=int, default=1, help="LLM(num_scheduler_steps=...) (num_spec 0)")
    args = p.parse_args()
    kw = {} if args.compile == "none" else dict(compile=args.compile, compile_after=0)
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=1, num_threads=1,
              draft_dtype=args.draft_dtype, num_scheduler_steps=args.scheduler_steps, **kw)
    llm.runner.graphs.trace_after = 0
    prompts = heldout_prompts(args.prompts, 64)
    base = dict(max_tokens=args.max_tokens, ignore_eos=True)
    kinds = {"greedy": SamplingParams(**base),
             "temperature 0.8, seeded": SamplingParams(**base, temperature=0.8, seed=1),
             "greedy, repetition_penalty 1.1": SamplingParams(**base, repetition_penalty=1.1),
             # Qwen3's generation_config.json with a chat's usual repetition penalty
             "temp 0.7, top_p 0.8, top_k 20, rep 1.05": SamplingParams(**base, temperature=0.7, top_p=0.8, top_k=20,
                                                                       repetition_penalty=1.05, seed=1)}
    print(f"host work per verify step (median us: the step's cycle less its graph replays), {args.model} num_spec "
          f"{args.num_spec}, compile {args.compile}, drafter dtype {args.draft_dtype or 'as the target'}, "
          f"{args.scheduler_steps} decode step(s) per scheduling, "
          f"{args.prompts} held-out prompts x {args.max_tokens} tokens at batch 1, one thread:")
    clock = GraphClock()
    for label, sp in kinds.items():
        for _ in range(2):   # every graph these generations replay, made
            llm.generate(prompts, sp)
        replace_graphs(llm.runner.graphs, graphs_of(llm.runner.graphs), lambda key, fn: getattr(fn, "timed", fn))
        replace_graphs(llm.runner.graphs, graphs_of(llm.runner.graphs), _timed_by(clock))
        host, graphs, events = [], [], 0
        for q in prompts:
            t, before = time.perf_counter(), clock.seconds
            steps = []
            for _ in llm.stream([q], sp):
                now = time.perf_counter()
                steps.append(((now - t - (clock.seconds - before)) * 1e6, (clock.seconds - before) * 1e6))
                t, before = now, clock.seconds
            host += [h for h, _ in steps[1:]]   # (the first event's cycle is the prefill's)
            graphs += [g for _, g in steps[1:]]
            events += len(steps) - 1
        h, g = statistics.median(host), statistics.median(graphs)
        per = len(prompts) * (args.max_tokens - 1) / events   # tokens per step (after the prefill's first)
        print(f"  {label:40s} host {h:7.1f} us, graphs {g:7.1f} us: host {h / (h + g):5.1%} of a step"
              + (f"; {per:.2f} tokens per step, host {h / per:6.1f} us per token" if args.scheduler_steps > 1 else ""))


def _timed_by(clock: GraphClock):
    def wrap(key, fn):
        timed = clock.timed(fn)
        timed.timed = fn   # the graph itself, to unwrap before the next configuration wraps again
        return timed
    return wrap


if __name__ == "__main__":
    main()
