"""Where a traced CPU decode step's time goes, per op kind (issue 32, item 3: the measurement
before and after the model-code cuts).

For each model, batch size and num_spec asked for, builds the engine (float32, one thread,
graphs traced on first use), generates a few tokens so that the verify (and, with drafts, the
propose) graph of that batch size is traced, then replays those graphs directly on their
static buffers: first timed (best of several rounds, no profiler), then under torch.profiler,
whose per-op self CPU time is aggregated by op kind (aten::mm, aten::mul, ...). It prints
per graph: aten op nodes in the traced graph, ms per replay, op calls per replay, and the op
kinds with their calls and share of the profiled self time. The profiler adds a fixed cost per
op, so its shares overweight cheap ops a little; the timed ms/replay is without it.

    python benchmarks/op_profile.py                         # both models, batch 1 and 8, num_spec 0 and 3
    python benchmarks/op_profile.py --models tiny-qwen3-next --batches 1 --num-spec 3 --top 25
    python benchmarks/op_profile.py --counts-only              # the graphs' aten node counts alone
"""

import argparse
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from mtpkit import LLM, SamplingParams

PROMPT = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")


def graph_ops(fn) -> Counter:
    """aten op nodes of a traced graph, by kind (nested blocks included)."""
    counts: Counter = Counter()

    def walk(block):
        for node in block.nodes():
            if node.kind().startswith("aten::"):
                counts[node.kind()] += 1
            for b in node.blocks():
                walk(b)
    walk(fn.graph)
    return counts


def traced_graphs(model: str, batch: int, num_spec: int) -> dict:
    """name -> (traced function, its arguments) for the batch's verify / propose graphs."""
    llm = LLM(model, num_spec=num_spec, dtype="float32", max_num_seqs=max(batch, 1), num_threads=1)
    g = llm.runner.graphs
    g.trace_after = 0
    llm.generate([PROMPT[i:] for i in range(batch)], SamplingParams(max_tokens=24, ignore_eos=True))
    key = max((k for k in g.verify_graphs if k[0] >= batch), key=lambda k: g._uses.get(k, 0))
    n = key[0]
    args = g._verify_args(n)
    out = {"verify": (g.verify_graphs[key], args)}
    if num_spec and g.propose_graphs.get(key) is not None:
        hidden = g.verify_graphs[key](*args)[0]   # (hidden, logits, greedy outcome)
        out["propose"] = (g.propose_graphs[key], g._propose_args(n, hidden))
    out["_llm"] = llm     # kept alive: the buffers belong to it
    return out


def measure(fn, args, rounds: int, reps: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def profile_kinds(fn, args, reps: int) -> tuple[dict, float]:
    """op kind -> (calls per replay, self CPU us per replay); total self us per replay."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn(*args)
    kinds = {}
    for e in prof.key_averages():
        if e.key.startswith("aten::") or e.key.startswith("mkldnn::"):
            kinds[e.key] = (e.count / reps, e.self_cpu_time_total / reps)
    return kinds, sum(us for _, us in kinds.values())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny-qwen3-next", "tiny-gemma4"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--num-spec", nargs="+", type=int, default=[0, 3])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--counts-only", action="store_true", help="only the graphs' aten node counts (no timing)")
    args = p.parse_args()
    torch.set_num_threads(1)
    summary = []
    with torch.inference_mode():
        for model in args.models:
            for batch in args.batches:
                for k in args.num_spec:
                    graphs = traced_graphs(model, batch, k)
                    llm = graphs.pop("_llm")
                    for name, (fn, fargs) in graphs.items():
                        if args.counts_only:
                            nodes = graph_ops(fn)
                            print(f"{model} batch {batch} num_spec {k} {name}: {sum(nodes.values())} aten nodes")
                            summary.append((model, batch, k, name, float("nan"), sum(nodes.values()), 0, 0))
                            continue
                        for _ in range(5):
                            fn(*fargs)
                        ms = measure(fn, fargs, args.rounds, args.reps)
                        nodes = graph_ops(fn)
                        kinds, total = profile_kinds(fn, fargs, args.reps)
                        calls = sum(c for c, _ in kinds.values())
                        print(f"\n{model} batch {batch} num_spec {k} {name}: {ms:.3f} ms/replay, "
                              f"{sum(nodes.values())} aten nodes in the graph, {calls:.0f} op calls/replay "
                              f"(profiled self time {total / 1e3:.3f} ms)")
                        for kind, (c, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:args.top]:
                            print(f"  {kind:40s} {c:6.0f} calls {us:8.1f} us {us / total:6.1%}  "
                                  f"{us / max(c, 1):6.2f} us/call")
                        mm = sum(us for kind, (c, us) in kinds.items()
                                 if kind in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"))
                        summary.append((model, batch, k, name, ms, sum(nodes.values()), calls, mm / total))
                    llm.close()
    print("\n| model | batch | num_spec | graph | ms/replay | aten nodes | op calls/replay | matmul share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, batch, k, name, ms, nodes, calls, mm in summary:
        print(f"| {model} | {batch} | {k} | {name} | {ms:.3f} | {nodes} | {calls:.0f} | {mm:.0%} |")


if __name__ == "__main__":
    main()
