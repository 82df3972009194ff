"""Throughput of 8 concurrent callers on one LLM vs the same prompts in one generate call.

Each caller (a thread; `--asyncio`: an asyncio task calling `agenerate`) generates its own
prompt; the engine batches every caller's requests together (mtpkit/engine/loop.py), so the
ratio should be close to 1. One process, one LLM; after a warm-up, `--rounds` rounds each run
both ways once, alternating which goes first (a noisy stretch of a shared machine hits both
alike). Prints each way's median tokens/s, the median over rounds of the same-round ratio
(callers / one call), the mean requests per step of each way, and checks that the outputs are
identical (greedy).

    python benchmarks/concurrent_callers.py
    python benchmarks/concurrent_callers.py --model tiny-gemma4 --num-spec 3 --max-tokens 128 --rounds 7 --asyncio
"""

import argparse
import asyncio
import statistics
import threading
import time

from mtpkit import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "for k in range(", "while True:", "try:\n",
           "x = [i for i in", "with open("]


def one_call(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def threads(llm, prompts, params):
    out = [None] * len(prompts)

    def caller(i):
        out[i] = llm.generate(prompts[i], params)[0].token_ids
    ths = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return out


def tasks(llm, prompts, params):
    async def main():
        outs = await asyncio.gather(*(llm.agenerate(p, params) for p in prompts))
        return [o[0].token_ids for o in outs]
    return asyncio.run(main())


def timed(fn, llm, prompts, params):
    steps = llm.engine.step_log.num_steps
    t0 = time.perf_counter()
    out = fn(llm, prompts, params)
    dt = time.perf_counter() - t0
    recs = [r for r in llm.engine.step_log.records() if r.index >= steps]
    return out, dt, statistics.mean(len(r.request_ids) for r in recs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--asyncio", action="store_true", help="callers are asyncio tasks (agenerate), not threads")
    a = p.parse_args()
    llm = LLM(a.model, num_spec=a.num_spec, max_num_seqs=8)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    callers = tasks if a.asyncio else threads
    want = one_call(llm, PROMPTS, params)   # warm-up (CPU traces) of both ways
    assert callers(llm, PROMPTS, params) == want
    times, ratios, width = {"one call": [], "8 callers": []}, [], {"one call": [], "8 callers": []}
    for r in range(a.rounds):
        order = [("one call", one_call), ("8 callers", callers)]
        same = {}
        for name, fn in order if r % 2 == 0 else order[::-1]:
            out, dt, w = timed(fn, llm, PROMPTS, params)
            assert out == want, f"{name}: outputs differ from one generate call"
            times[name].append(dt)
            width[name].append(w)
            same[name] = dt
        ratios.append(same["one call"] / same["8 callers"])   # throughput ratio: callers / one call
    tokens = len(PROMPTS) * a.max_tokens
    print(f"{a.model} num_spec={a.num_spec} max_tokens={a.max_tokens} rounds={a.rounds} "
          f"callers={'asyncio tasks' if a.asyncio else 'threads'}")
    for name in times:
        print(f"  {name:10s} {tokens / statistics.median(times[name]):8.1f} tok/s   "
              f"mean requests per step {statistics.mean(width[name]):.2f}")
    print(f"  throughput ratio (8 callers / one call, median of same-round ratios): {statistics.median(ratios):.3f}")
    print("  outputs identical: yes")


if __name__ == "__main__":
    main()
