"""A drafter in bfloat16 beside a float32 target (LLM(draft_dtype="bfloat16")) against the same
engine with a float32 drafter, on whole generations: per model, the two engines at its num_spec,
bench_cpu's 8 held-out prompts x 128 tokens at batch 1, one thread, prefix cache off, alternated
in rounds (the ratio is the median of same-round ratios); the tokens must be identical (the target
verifies every draft). On the traced graphs (default) or compiled ones (`--compile MODE`, compiled
in the warm-up; bench_cpu.py --draft-dtype runs the compiled comparison beside llama.cpp).

    python benchmarks/draft_dtype.py                      # traced: tiny-qwen3-next and tiny-gemma4, num_spec 3
    python benchmarks/draft_dtype.py --compile aot-tuned --num-spec 7 3
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import heldout_prompts, ratio, round_robin  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.engine.args import COMPILE_MODES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny-qwen3-next", "tiny-gemma4"])
    p.add_argument("--num-spec", type=int, nargs="+", default=[3], help="one per model, or one for all")
    p.add_argument("--compile", choices=COMPILE_MODES, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    specs = args.num_spec * len(args.models) if len(args.num_spec) == 1 else args.num_spec
    prompts, sp = heldout_prompts(8, 64), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    how = f"compiled ({args.compile})" if args.compile else "traced"
    print(f"torch {torch.__version__}; one thread; {len(prompts)} held-out prompts x {args.max_tokens} tokens at "
          f"batch 1, {how}; {args.rounds} rounds, engines alternated")
    for model, k in zip(args.models, specs):
        kw = dict(compile=args.compile, compile_after=0) if args.compile else {}
        engines = {dt: LLM(model, num_spec=k, dtype="float32", max_num_seqs=1, enable_prefix_caching=False,
                           draft_dtype=dt, **kw) for dt in ("float32", "bfloat16")}
        for llm in engines.values():
            llm.runner.graphs.trace_after = 0
        fns = {dt: (lambda llm=llm: [llm.generate([q], sp)[0].token_ids for q in prompts])
               for dt, llm in engines.items()}
        times, results = round_robin(fns, args.rounds)
        n = len(prompts) * args.max_tokens
        print(f"{model} num_spec={k}: identical tokens {results['float32'] == results['bfloat16']}")
        for dt, llm in engines.items():
            llm.stats.__init__(num_spec=k)
            llm.generate(prompts, sp)
            print(f"  {dt:8s} drafter {n / statistics.median(times[dt]):8.1f} tok/s  x{ratio(times, dt, 'float32'):.3f} "
                  f"the float32 drafter's speed; mean acceptance length {llm.stats.mean_acceptance_length:.2f}")


if __name__ == "__main__":
    main()
