"""Where a traced CPU decode step spends its time: each part taken out, against the whole step.

Builds the embedded model's engine once per variant (the whole model, and the model with one
part replaced by a cheap stand-in of the same shape: the MoE blocks, the GDN recurrences, the
causal convs, the attention kernels), in the order A B B A so that allocation order cannot
favour a variant, traces its verify and propose graphs, and times them interleaved in one
process (best of several rounds). The difference to the whole step is what that part costs
inside the step, caches and all (a per-op profiler attributes time badly at these sizes).
The parts interact (taking one out also leaves more cache to the rest), so their costs do not
add up to the step; the propose graph runs no GDN layer and no conv, so its lines for those
two show the noise floor of the measurement.

    python benchmarks/graph_ablation.py --num-spec 3
"""

import argparse
import dataclasses
import time

import torch

from mtpkit import LLM, SamplingParams
from mtpkit.kernels.ops import TORCH
from mtpkit.layers.moe import SparseMoE


def _set_ops(llm, **replace):
    ops = dataclasses.replace(TORCH, **replace)
    for m in llm.model.modules():
        if hasattr(m, "ops"):
            m.ops = ops


VARIANTS = {
    "whole step": lambda llm: None,
    "without MoE": lambda llm: [setattr(m, "forward", lambda x: x * 0.5)
                                for m in llm.model.modules() if isinstance(m, SparseMoE)],
    "without GDN recurrence": lambda llm: _set_ops(llm, gated_delta_rule_verify=lambda q, k, v, *a: v * 1.0),
    "without causal conv": lambda llm: _set_ops(llm, causal_conv1d_verify=lambda x, *a: x * 1.0),
    "without attention": lambda llm: _set_ops(llm, paged_attention_verify=lambda q, *a, **k: q * 1.0,
                                              write_kv=lambda *a: None),
}


def graphs(variant, num_spec: int, prompt: list[int]):
    llm = LLM("tiny-qwen3-next", num_spec=num_spec, dtype="float32")
    VARIANTS[variant](llm)
    llm.runner.graphs.trace_after = 0
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    llm.generate([prompt], sp)
    g = llm.runner.graphs
    n = g._last.num_reqs_padded
    key = (n, g._last.traced_context)
    verify_args = g._verify_args(n)
    out = {"verify": lambda: g.verify_graphs[key](*verify_args)}
    if num_spec:
        args = g._propose_args(n, g.outputs[n]["hidden"])
        out["propose"] = lambda: g.propose_graphs[key](*args)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompt = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n")
    names = list(VARIANTS)
    timed = [(name, *item) for name in names + names[::-1]
             for item in graphs(name, args.num_spec, prompt).items()]
    best = [float("inf")] * len(timed)
    with torch.inference_mode():
        for _, _, fn in timed:
            for _ in range(10):
                fn()
        for _ in range(args.rounds):
            for i, (_, _, fn) in enumerate(timed):
                t = time.perf_counter()
                for _ in range(20):
                    fn()
                best[i] = min(best[i], (time.perf_counter() - t) / 20 * 1e3)
    ms: dict = {}
    for (name, graph, _), b in zip(timed, best):
        ms.setdefault(graph, {}).setdefault(name, []).append(b)
    print(f"num_spec={args.num_spec} (bundle {args.num_spec + 1}), threads={torch.get_num_threads()}, "
          f"best of {args.rounds} rounds, two engines per variant")
    for graph, by_name in ms.items():
        whole = sum(by_name["whole step"]) / 2
        print(f"\n{graph} graph: {whole:.2f} ms")
        for name in names[1:]:
            t = sum(by_name[name]) / 2
            print(f"  {name:24s} {t:6.2f} ms   the part costs {whole - t:5.2f} ms ({(whole - t) / whole:4.0%})")


if __name__ == "__main__":
    main()
