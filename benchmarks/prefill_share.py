"""How much of a whole generation the prefill takes (issue 32): one engine, the bench's held-out
prompts one at a time (batch 1, one thread, float32, prefix cache off, greedy, ignore_eos), timing
each generation, its prefill step (ModelRunner._prefill), the target's forward inside it and
the drafter's proposal after it (captured like a decode step), on two engines alternated in rounds:
one whose one-chunk prefills replay the captured prefill (CapturedSteps.prefill, traced or
compiled like the decode graphs), one whose prefills all run eager; prints both and their ratios.
Medians over `--rounds` passes over the prompts after a warm-up generation.

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


def build(args, captured_prefill: bool) -> LLM:
    extra = {"compile": args.compile, "compile_after": 0} if args.compile else {}
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=1, enable_prefix_caching=False,
              **extra)
    llm.runner.graphs.trace_after = 0
    if not captured_prefill:   # every prefill eager (CapturedSteps.prefill declines)
        llm.runner.graphs.prefill = lambda *a, **k: None
    return llm


def instrument(llm: LLM, times: dict) -> None:
    runner = llm.runner

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key].append(time.perf_counter() - t)
        setattr(obj, name, wrapper)
    # The target's forward: the captured prefill's replay, or the model called eager (only the
    # prefill calls it outside the graphs; a declined captured prefill costs a dict lookup): one
    # entry per prefill step, the sum of both.
    timed(runner.graphs, "prefill", "target forward")
    timed(runner.model, "forward", "target forward")
    timed(runner, "_prefill_drafts", "proposal after it")
    step = runner._prefill

    def prefill_step(*a, **k):
        forward = times["target forward"]
        n = len(forward)
        t = time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            times["prefill step"].append(time.perf_counter() - t)
            forward[n:] = [sum(forward[n:])]
    runner._prefill = prefill_step


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
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    kinds = ("captured prefill", "eager prefill")
    engines = {kind: build(args, kind == "captured prefill") for kind in kinds}
    times = {kind: {"generation": [], "prefill step": [], "target forward": [], "proposal after it": []}
             for kind in kinds}
    outputs = {kind: [] for kind in kinds}
    for kind, llm in engines.items():
        llm.generate(prompts[:1], sp)   # warm-up: traces (or loads) every graph this generation uses
        instrument(llm, times[kind])
    for r in range(args.rounds):   # alternated: a noisy stretch of the machine hits both alike
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            for prompt in prompts:
                t = time.perf_counter()
                out = engines[kind].generate([prompt], sp)[0].token_ids
                times[kind]["generation"].append(time.perf_counter() - t)
                if r == 0:
                    outputs[kind].append(out)
    print(f"{args.model} num_spec={args.num_spec} compile={args.compile}: {args.prompt_len}-token prompts, "
          f"{args.max_tokens} new tokens, batch 1, one thread; medians over {args.rounds * len(prompts)} generations "
          "per engine, the engines alternated in rounds")
    med = {}
    for kind in kinds:
        gen = statistics.median(times[kind]["generation"])
        print(f" {kind}:")
        for key, v in times[kind].items():
            m = med[kind, key] = statistics.median(v) if v else float("nan")
            print(f"  {key:<18} {m * 1e3:8.2f} ms  {100 * m / gen:5.1f}% of a generation  ({len(v)} calls)")
    for key in ("generation", "prefill step", "target forward"):
        print(f" {key}: captured / eager prefill x{med[kinds[0], key] / med[kinds[1], key]:.2f}")
    print(f" greedy outputs equal: {outputs[kinds[0]] == outputs[kinds[1]]}")


if __name__ == "__main__":
    main()
