"""A proposal's context rounded up to whole blocks of 16 keys (speculative/drafter.CTX_MULTIPLE)
against the exact length, on whole generations (issue 32).

A compiled one-token pass of the MTP head multiplies q by K^T over the proposal's context (the
context bucket + num_spec keys: 135 at bucket 128 and num_spec 7). Inductor's GEMM template packs
K^T in blocks of 16 columns, and a ragged last block made it pack one masked scalar at a time;
at a multiple of 16 it packs with vectorised 16 x 16 transposes
(`TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 python benchmarks/aot_kernel_profile.py` shows both).

Per drafter dtype, two "aot-tuned" tiny-qwen3-next engines at num_spec 7, each compiled on its own
package directory (the packages are named by the source, which the rounding constant does not
change) with CTX_MULTIPLE 1 or 16 set while it runs, generate the 8 held-out prompts x 128 tokens
at batch 1 on one thread, alternated in rounds; the ratio is the median of same-round ratios, and
the tokens must be identical (the target verifies every draft).

    python benchmarks/proposal_context.py                      # float32 and bfloat16 drafters
    python benchmarks/proposal_context.py --draft-dtypes float32 --rounds 9
"""

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import heldout_prompts, ratio, round_robin  # noqa: E402

import torch  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.speculative import drafter  # noqa: E402


@contextlib.contextmanager
def ctx_multiple(m: int):
    before, drafter.CTX_MULTIPLE = drafter.CTX_MULTIPLE, m
    try:
        yield
    finally:
        drafter.CTX_MULTIPLE = before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-spec", type=int, default=7)
    p.add_argument("--draft-dtypes", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    print(f"torch {torch.__version__}; tiny-qwen3-next num_spec {args.num_spec}, aot-tuned, one thread; 8 held-out "
          f"prompts x {args.max_tokens} tokens at batch 1; {args.rounds} rounds, engines alternated; ratio: the "
          "median of same-round ratios")
    prompts, sp = heldout_prompts(8, 64), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    n = len(prompts) * args.max_tokens
    with tempfile.TemporaryDirectory(prefix="mtpkit-proposal-context-") as tmp:
        for dt in args.draft_dtypes:
            engines = {}
            for m in (1, 16):
                with ctx_multiple(m):   # compiled in its first generation (compile_after=0)
                    llm = LLM("tiny-qwen3-next", num_spec=args.num_spec, dtype="float32", max_num_seqs=1,
                              num_threads=1, enable_prefix_caching=False, compile="aot-tuned", compile_after=0,
                              compile_cache_dir=f"{tmp}/{dt}-{m}", draft_dtype=dt)
                    llm.runner.graphs.trace_after = 0
                    llm.generate(prompts, sp)
                engines[m] = llm

            def run(m):
                with ctx_multiple(m):
                    return [engines[m].generate([q], sp)[0].token_ids for q in prompts]
            times, results = round_robin({m: (lambda m=m: run(m)) for m in engines}, args.rounds)
            print(f"draft dtype {dt}: identical tokens {results[1] == results[16]}")
            for m in engines:
                print(f"  context a multiple of {m:2d}: {n / statistics.median(times[m]):8.1f} tok/s  "
                      f"x{ratio(times, m, 1):.3f} the exact length's speed")


if __name__ == "__main__":
    main()
