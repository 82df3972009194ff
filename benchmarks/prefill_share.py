"""How much of a whole generation the prefill takes (issue 32): one engine, the bench's held-out
prompts one at a time (batch 1, one thread, float32, prefix cache off, greedy, ignore_eos), timing
each generation, its prefill step (ModelRunner._prefill), the target's forward inside it
(eager: a prefill is never captured) and the drafter's proposal after it (captured like a
decode step). Medians over `--rounds` passes over the prompts after a warm-up generation.

    python benchmarks/prefill_share.py --num-spec 7 --compile aot-tuned
    python benchmarks/prefill_share.py --model tiny-gemma4 --num-spec 3 --compile aot-tuned

With --compile, the engine is built as bench_cpu.py builds its batch-1 engines (max_num_seqs=1,
compile_after=0), so it loads the AOT packages that bench left.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu import heldout_prompts  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.engine.args import COMPILE_MODES  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--compile", choices=COMPILE_MODES, default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    extra = {"compile": args.compile, "compile_after": 0} if args.compile else {}
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=1, enable_prefix_caching=False,
              **extra)
    llm.runner.graphs.trace_after = 0
    runner = llm.runner
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], sp)   # warm-up: traces (or loads) every graph this generation uses
    times = {"generation": [], "prefill step": [], "target forward": [], "proposal after it": []}

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key].append(time.perf_counter() - t)
        setattr(obj, name, wrapper)
    timed(runner, "_prefill", "prefill step")
    timed(runner.model, "forward", "target forward")   # only the prefill calls it outside the graphs
    timed(runner, "_prefill_drafts", "proposal after it")
    for _ in range(args.rounds):
        for prompt in prompts:
            t = time.perf_counter()
            llm.generate([prompt], sp)
            times["generation"].append(time.perf_counter() - t)
    gen = statistics.median(times["generation"])
    print(f"{args.model} num_spec={args.num_spec} compile={args.compile}: {args.prompt_len}-token prompts, "
          f"{args.max_tokens} new tokens, batch 1, one thread; medians over {len(times['generation'])} generations")
    for key, v in times.items():
        m = statistics.median(v) if v else float("nan")
        print(f"  {key:<18} {m * 1e3:8.2f} ms  {100 * m / gen:5.1f}% of a generation  ({len(v)} calls)")


if __name__ == "__main__":
    main()
