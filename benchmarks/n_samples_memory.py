"""KV blocks and prefill work of n samples of one prompt (SamplingParams.n: the prompt prefilled
once, its blocks shared, copy-on-write) against n separate requests of the same prompt, in one
run on the same LLM (the embedded tiny-qwen3-next, CPU).

For each prompt length it prints, for both ways: the peak of KV blocks held at once (sampled
after every step: capacity - free), the prompt tokens prefilled, the blocks copied on write,
and the wall time; then the ratios shared / separate. The samples are the same tokens either
way (sample i == the separate request of seed + i: checked).

    python benchmarks/n_samples_memory.py [--n 4] [--max-tokens 16] [--num-spec 3]
"""

import argparse
import time

from mtpkit import LLM, SamplingParams
from mtpkit.engine.scheduler import StepKind


def run(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> dict:
    runner, stats = llm.engine.runner, {"prefilled": 0, "copied": 0, "peak": 0}
    execute = runner.execute

    def counting(plan):
        if plan.kind == StepKind.PREFILL:
            stats["prefilled"] += sum(plan.chunk_lens)
        stats["copied"] += len(plan.copies.blocks)
        return execute(plan)
    runner.execute = counting
    reqs = [llm.add_request(prompt, p) for p in params]
    t0 = time.perf_counter()
    try:
        while llm.scheduler.has_unfinished():
            llm.step()
            held = sum(llm.kv_pools.capacity[k] - v for k, v in llm.kv_pools.num_free.items())
            stats["peak"] = max(stats["peak"], held)
    finally:
        del runner.execute
    stats["seconds"] = time.perf_counter() - t0
    stats["tokens"] = [s.output_token_ids for r in reqs for s in (r.samples or [r])]
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 250, 1000])
    a = ap.parse_args(argv)
    llm = LLM("tiny-qwen3-next", num_spec=a.num_spec, max_model_len=max(a.lengths) + a.max_tokens + 8,
              max_num_seqs=a.n)
    print(f"n={a.n}, max_tokens={a.max_tokens}, num_spec={a.num_spec}, block_size={llm.engine_config.block_size}")
    print(f"{'prompt':>7} | {'peak blocks':>17} | {'prefill tokens':>17} | {'copied':>6} | {'seconds':>15} | ratios")
    for length in a.lengths:
        prompt = [(37 * j) % 200 + 3 for j in range(length)]
        sp = {"temperature": 0.8, "seed": 11, "max_tokens": a.max_tokens, "ignore_eos": True}
        shared = run(llm, prompt, [SamplingParams(n=a.n, **sp)])
        separate = run(llm, prompt, [SamplingParams(**{**sp, "seed": 11 + i}) for i in range(a.n)])
        assert shared["tokens"] == separate["tokens"], "sample i must equal the request of seed + i"
        print(f"{length:>7} | {shared['peak']:>7} vs {separate['peak']:>7} | {shared['prefilled']:>7} vs "
              f"{separate['prefilled']:>7} | {shared['copied']:>6} | {shared['seconds']:>6.2f} vs "
              f"{separate['seconds']:>6.2f} | blocks {shared['peak'] / separate['peak']:.2f}, prefill "
              f"{shared['prefilled'] / separate['prefilled']:.2f}, time {shared['seconds'] / separate['seconds']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
