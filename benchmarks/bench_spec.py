"""Speculative decoding with num_spec = 0..4 on the same prompts, in one process.

Prints, per num_spec: tokens/s (after a first, "cold" run of the same call, whose tok/s is
shown too: it includes capturing the graphs) and its ratio to num_spec=0, target forward
passes per generated token, mean acceptance length, and the host time spent building metadata
per step.
All greedy outputs are checked to be identical to num_spec=0 (losslessness).

    python benchmarks/bench_spec.py                       # the embedded model
    python benchmarks/bench_spec.py --model DIR --batch 8 --max-tokens 128
"""

import argparse
import time

import torch

import mtpkit
from mtpkit import LLM, SamplingParams
from mtpkit.step import metadata as md

PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
    "def quicksort(items):\n    ", "for i in range(10):\n    ", "# Parse the command line\nimport argparse\n",
    "def read_file(path):\n    with open(path) as f:", "    return self._cache[key]\n\n    def ",
]


class MetadataTimer:
    """Wraps the metadata builders wherever they are called from, and sums their time."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1
        return timed


def run(model, k, prompts, max_tokens, args, timer):
    llm = LLM(model, num_spec=k, dtype=args.dtype, max_num_seqs=max(len(prompts), 1),
              enforce_eager=args.eager)
    if llm.runner.graphs is not None:  # steady state: trace CPU graphs on first use (see graphs.captured)
        llm.runner.graphs.trace_after = args.trace_after
    steps = {"prefill": 0, "verify": 0}
    execute = llm.runner.execute

    def counted(plan):
        steps[plan.kind.value] += 1
        return execute(plan)

    llm.runner.execute = counted
    if llm.tokenizer is None:  # a checkpoint without tokenizer.json: bytes as token ids
        prompts = [[b % llm.model_config.vocab_size for b in p.encode()] for p in prompts]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # Cold: the first run of these shapes also captures (traces, on CPU) the graphs it meets.
    t = time.perf_counter()
    cold = llm.generate(prompts, sp)
    cold_s = time.perf_counter() - t
    steps.update(prefill=0, verify=0)
    llm.stats = mtpkit.SpecStats(num_spec=k)
    timer.seconds, timer.calls = 0.0, 0
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    total_steps = steps["prefill"] + steps["verify"]
    return dict(k=k, tok_s=n / dt, cold_tok_s=sum(len(o.token_ids) for o in cold) / cold_s, passes=total_steps / n * len(prompts), mal=llm.stats.mean_acceptance_length,
                meta_ms=timer.seconds / max(total_steps, 1) * 1e3, tokens=[o.token_ids for o in outs],
                steps=total_steps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-spec", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--eager", action="store_true", help="enforce_eager (no graph runner)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--trace-after", type=int, default=0,
                   help="CPU: direct calls of a graph shape before it is traced (the engine's default is 32)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    timer = MetadataTimer()
    # Patch the builders where they are looked up (modules import them by name).
    import mtpkit.engine.runner as runner_mod
    import mtpkit.graphs.captured as graphs_mod
    originals = {name: getattr(md, name) for name in ("build_prefill", "build_uniform")}
    for mod in (runner_mod, graphs_mod):
        for name, fn in originals.items():
            if hasattr(mod, name):
                setattr(mod, name, timer.wrap(fn))
    prompts = (PROMPTS * ((args.batch + len(PROMPTS) - 1) // len(PROMPTS)))[: args.batch]
    rows = [run(args.model, k, prompts, args.max_tokens, args, timer) for k in range(args.max_spec + 1)]
    base = rows[0]
    print(f"model={args.model} batch={args.batch} max_tokens={args.max_tokens} dtype={args.dtype} "
          f"threads={torch.get_num_threads()} graph_path={not args.eager}")
    print(f"{'num_spec':>8} {'tok/s':>9} {'x base':>7} {'cold tok/s':>10} {'passes/tok':>10} "
          f"{'mean acc len':>12} {'meta ms/step':>12} {'lossless':>8}")
    for r in rows:
        same = r["tokens"] == base["tokens"]
        print(f"{r['k']:>8} {r['tok_s']:>9.1f} {r['tok_s'] / base['tok_s']:>7.2f} {r['cold_tok_s']:>10.1f} "
              f"{r['passes']:>10.3f} {r['mal']:>12.2f} {r['meta_ms']:>12.3f} {str(same):>8}")
    if not all(r["tokens"] == base["tokens"] for r in rows):
        raise SystemExit("greedy outputs differ between num_spec values: not lossless")


if __name__ == "__main__":
    main()
