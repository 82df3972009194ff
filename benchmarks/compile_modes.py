"""Compiled CPU decode graphs (LLM(compile=...), mtpkit/graphs/compiled.py) against the
TorchScript trace they replace: per graph, the ms of one replay, trace vs compiled, alternated
in the same process and rounds; the compile time per graph cold (empty caches) and warm (the
same caches, a new process); and whether greedy tokens are identical compiled vs traced vs eager.

Each (mode, model, num_spec) runs in two child processes on one fresh cache directory (inductor's
TORCHINDUCTOR_CACHE_DIR and the AOT packages' compile_cache_dir): the first compiles cold, the
second warm, and times the replays.

    python benchmarks/compile_modes.py --threads 1                       # every mode, both models, num_spec 0 and 3
    python benchmarks/compile_modes.py --modes inductor aot --models tiny-qwen3-next --num-spec 3
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

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]


def child(args) -> dict:
    import torch

    from mtpkit import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(num_spec=args.k, dtype="float32", max_num_seqs=args.batch)
    prompts = [p for p in PROMPTS for _ in range(args.batch)][:max(args.batch, 2)]

    def tokens(llm):
        return [o.token_ids for i in range(0, len(prompts), args.batch)
                for o in llm.generate(prompts[i:i + args.batch], sp)]
    eager = tokens(LLM(args.model, enforce_eager=True, **kw))
    traced = LLM(args.model, **kw)
    traced.runner.graphs.trace_after = 0
    trace_tokens = tokens(traced)
    del traced
    llm = LLM(args.model, compile=args.mode, compile_after=0, compile_cache_dir=args.cache / "aot", **kw)
    g = llm.runner.graphs
    g.trace_after = 0
    t = time.perf_counter()
    out = tokens(llm)
    first = time.perf_counter() - t
    res = {"same_as_trace": out == trace_tokens, "same_as_eager": out == eager, "trace_same_as_eager":
           trace_tokens == eager, "first_generation_s": first,
           "compile": {r.name: [r.seconds, r.cached, r.error] for r in g.compiler.records}, "steps": {}}
    if not args.time:
        return res
    n = args.batch
    with torch.inference_mode():
        for (n_, context), verify in g.verify_graphs.items():
            if n_ != n:
                continue
            propose = g.propose_graphs[n, context]
            g.buf.make_inert(n, g.bundle)   # replays below write only null storage
            vargs = g._verify_args(n)
            hidden = verify(*vargs)[0]
            pargs = g._propose_args(n, hidden)
            graphs = {"verify": (verify, vargs)}
            if propose is not None:
                graphs["propose"] = (propose, pargs)
            for what, (graph, a) in graphs.items():
                fns = {"trace": graph.traced, "compiled": graph.compiled}
                times = {k: [] for k in fns}
                for _ in range(args.rounds):
                    for k, fn in fns.items():
                        fn(*a)
                        t = time.perf_counter()
                        for _ in range(args.reps):
                            fn(*a)
                        times[k].append((time.perf_counter() - t) / args.reps * 1e3)
                res["steps"][f"{what}_{n}_{context}"] = {k: statistics.median(v) for k, v in times.items()}
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["inductor", "aot", "freeze"])
    p.add_argument("--models", nargs="+", default=["tiny-qwen3-next", "tiny-gemma4"])
    p.add_argument("--num-spec", nargs="+", type=int, default=[0, 3])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--time", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    print(f"batch {args.batch}, threads {args.threads}; per-step ms: median over {args.rounds} rounds of "
          f"{args.reps} replays, trace and compiled alternated; compile s per graph: cold (empty caches), "
          f"warm (a new process on the same caches)")
    all_same = True
    for model in args.models:
        for k in args.num_spec:
            for mode in args.modes:
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(cache) / "inductor"))
                    runs = []
                    for warm in (False, True):
                        cmd = [sys.executable, __file__, "--child", "--mode", mode, "--model", model, "--k", str(k),
                               "--cache", cache, "--batch", str(args.batch), "--threads", str(args.threads),
                               "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds),
                               "--reps", str(args.reps)] + (["--time"] if warm else [])
                        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                        if not line:
                            raise SystemExit(f"{mode} {model} k={k} failed:\n{out.stderr[-3000:]}")
                        runs.append(json.loads(line[0][7:]))
                cold, hot = runs
                same = all(r["same_as_trace"] and r["same_as_eager"] for r in runs)
                all_same &= same
                print(f"\n{model} num_spec={k} mode={mode}: tokens equal compiled = traced = eager: {same}")
                for name, (secs, cached, err) in cold["compile"].items():
                    w = hot["compile"].get(name, [float("nan"), False, None])
                    print(f"  compile {name:<28} cold {secs:7.1f} s  warm {w[0]:6.1f} s"
                          f"{' (package cache)' if w[1] else ''}{'  FAILED: ' + err[:200] if err else ''}")
                for name, t in hot["steps"].items():
                    print(f"  step {name:<16} trace {t['trace']:6.3f} ms  compiled {t['compiled']:6.3f} ms  "
                          f"x{t['trace'] / t['compiled']:.2f}")
    print(f"\nall greedy outputs identical: {all_same}")


if __name__ == "__main__":
    main()
