"""Whole generations of the working tree against a git revision, alternated in the same rounds
(issue 32): the A/B for a change to what a step runs, where a kernel profile alone misleads
(docs/performance.md, "One-row products": a product x0.31 alone, x0.996 in the generation).

The revision is checked out into a temporary git worktree; one worker process per side imports
mtpkit from its own tree (PYTHONPATH; the worker prints which), builds the engine (compiled
graphs under `--compile`, in its warm-up: each tree's packages are named by its own source), and
then times bench_cpu's 8 held-out prompts x `--max-tokens` tokens at batch 1 (`--batch`) on one thread
whenever the parent asks. The parent asks the two in turn, swapping who goes first each round,
so only one runs at a time; the ratio is the median of same-round ratios, and the tokens must be
identical. It also times the graphs' replays in each side, and prints the time outside them (the
host work) per token: a host change is measured without the graphs' run-to-run spread.

    python benchmarks/ab_revisions.py --base HEAD                       # uncommitted changes vs HEAD
    python benchmarks/ab_revisions.py --base HEAD~1 --model tiny-gemma4 --num-spec 3 --draft-dtype bfloat16
    python benchmarks/ab_revisions.py --base 1e34a40 --compile none --num-spec 3   # traced graphs
    python benchmarks/ab_revisions.py --base HEAD --compile none --num-spec 3 --temperature 0.8   # seeded sampling
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    """Reads "run" lines on stdin; answers each with one JSON line (seconds, tokens)."""
    import torch

    import mtpkit   # first: from the side's own tree (PYTHONPATH), before bench_cpu puts ROOT on sys.path
    from mtpkit import LLM, SamplingParams

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cpu import heldout_prompts
    from graph_clock import GraphClock, graphs_of, replace_graphs
    torch.set_num_threads(1)
    kw = dict(compile=args.compile, compile_after=0) if args.compile != "none" else {}
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=args.batch, num_threads=1,
              enable_prefix_caching=False, draft_dtype=args.draft_dtype, **kw)
    if llm.runner.graphs is not None:
        llm.runner.graphs.trace_after = 0
    sampled = dict(temperature=args.temperature, seed=1) if args.temperature else {}
    if args.repetition_penalty != 1.0:
        sampled["repetition_penalty"] = args.repetition_penalty
    prompts, sp = heldout_prompts(8, 64), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **sampled)
    for _ in range(2):   # compiles / traces every graph the rounds use
        llm.generate(prompts, sp)
    # The time inside the graphs' replays, so that the host's share (the rest) is compared on its
    # own: a host change of tens of microseconds a step is lost in the graphs' run-to-run spread.
    clock = GraphClock()
    if llm.runner.graphs is not None:   # every graph the rounds replay was made in the warm-up
        replace_graphs(llm.runner.graphs, graphs_of(llm.runner.graphs), lambda key, fn: clock.timed(fn))
    print(json.dumps({"ready": mtpkit.__file__}), flush=True)
    for line in sys.stdin:
        clock.seconds = 0.0
        t = time.perf_counter()
        tokens = [o.token_ids for i in range(0, len(prompts), args.batch)
                  for o in llm.generate(prompts[i:i + args.batch], sp)]
        print(json.dumps({"seconds": time.perf_counter() - t, "graphs": clock.seconds, "tokens": tokens}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=7)
    p.add_argument("--compile", default="aot-tuned", help="LLM(compile=...), or none (traced graphs)")
    p.add_argument("--draft-dtype", default=None)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling (seed 1), not greedy")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="a generation control on every request")
    p.add_argument("--batch", type=int, default=1, help="prompts per call (max_num_seqs): 1 or 8")
    p.add_argument("--fresh", action="store_true",
                   help="each side compiles into an empty package cache of its own (MTPKIT_CACHE): a cold compile's "
                        "max-autotune picks vary from compile to compile, so a side whose packages were cached would "
                        "be compared against the other side's fresh picks")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    print(f"working tree vs {args.base} ({rev}): {args.model} num_spec {args.num_spec}, compile {args.compile}, "
          f"drafter dtype {args.draft_dtype or 'as the target'}; 8 held-out prompts x {args.max_tokens} tokens at batch {args.batch}, "
          f"one thread, prefix cache off; {args.rounds} rounds, sides alternated; ratio: the median of same-round "
          "ratios", flush=True)
    with tempfile.TemporaryDirectory(prefix="mtpkit-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            argv = [a for a in sys.argv[1:] if a != "--fresh"]
            sides = {}
            for name, tree in (("working tree", ROOT), (f"base {rev}", base)):
                env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
                if args.fresh:
                    env["MTPKIT_CACHE"] = str(Path(tmp) / f"cache-{len(sides)}")
                sides[name] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--worker"],
                                               cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               text=True)
                # (one warm-up at a time: both would share the 2 cores while compiling)
                ready = json.loads(sides[name].stdout.readline())["ready"]
                print(f"  {name}: mtpkit from {ready}", flush=True)
                if not ready.startswith(str(tree)):
                    raise SystemExit(f"the {name} worker imported mtpkit from {ready}, not {tree}")
            times, graph_times, tokens = {n: [] for n in sides}, {n: [] for n in sides}, {}
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    sides[name].stdin.write("run\n")
                    sides[name].stdin.flush()
                    out = json.loads(sides[name].stdout.readline())
                    times[name].append(out["seconds"])
                    graph_times[name].append(out["graphs"])
                    tokens[name] = out["tokens"]
            for s in sides.values():
                s.stdin.close()
                s.wait()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    a, b = sides
    n = 8 * args.max_tokens
    ratio = statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))
    print(f"identical tokens: {tokens[a] == tokens[b]}")
    for name in sides:
        print(f"  {name:22s} {n / statistics.median(times[name]):8.1f} tok/s")
    print(f"  working tree x{ratio:.3f} the base's speed (same-round ratios {min(tb / ta for ta, tb in zip(times[a], times[b])):.3f}"
          f"..{max(tb / ta for ta, tb in zip(times[a], times[b])):.3f})")
    # Outside the graphs' replays: the host work (and the eager parts of a prefill), per token.
    host = {name: [(t - gt) / n * 1e6 for t, gt in zip(times[name], graph_times[name])] for name in sides}
    inside = {name: [gt / n * 1e6 for gt in graph_times[name]] for name in sides}
    for name in sides:
        print(f"  {name:22s} outside the graphs {statistics.median(host[name]):7.1f} us/token, "
              f"inside {statistics.median(inside[name]):7.1f} us/token")
    diffs = [hb - ha for ha, hb in zip(host[a], host[b])]
    print(f"  outside the graphs, working tree - base: {-statistics.median(diffs):+.1f} us/token "
          f"(same-round differences {-max(diffs):+.1f}..{-min(diffs):+.1f})")


if __name__ == "__main__":
    main()
