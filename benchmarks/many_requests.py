"""Does a call's cost per request stay flat as the call grows? One LLM, one process: `generate`
over N short requests (2 new tokens each, distinct seeds, sampled) for a small and a large N,
alternated in rounds; prints the median time per request at each N and their ratio (large / small).
A ratio near 1 is linear; well above 1, something in the call is quadratic in its requests (the
Request dataclass's field-by-field __eq__ in the scheduler's and stream's membership tests was:
12 s of a 17 s call of 1,200 requests).

    python benchmarks/many_requests.py
    python benchmarks/many_requests.py --small 100 --large 1600 --rounds 3
"""

import argparse
import statistics
import time

from mtpkit import LLM, SamplingParams


def per_request(llm: LLM, n: int, prompt: str) -> float:
    params = [SamplingParams(max_tokens=2, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    t = time.perf_counter()
    outs = llm.generate([prompt] * n, params)
    dt = time.perf_counter() - t
    assert len(outs) == n and all(len(o.outputs[0].token_ids) == 2 for o in outs)
    return dt / n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=2)
    p.add_argument("--small", type=int, default=100)
    p.add_argument("--large", type=int, default=1600)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    llm = LLM(args.model, num_spec=args.num_spec, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    prompt = "def f(x):"
    per_request(llm, args.small, prompt)   # warm-up: traces, first allocations
    times = {args.small: [], args.large: []}
    for r in range(args.rounds):
        for n in ((args.small, args.large) if r % 2 == 0 else (args.large, args.small)):
            times[n].append(per_request(llm, n, prompt))
    small, large = (statistics.median(times[n]) for n in (args.small, args.large))
    print(f"{args.model} num_spec={args.num_spec} max_num_seqs={args.max_num_seqs}, {args.rounds} rounds")
    print(f"  {args.small:5d} requests: {small * 1e3:.2f} ms per request")
    print(f"  {args.large:5d} requests: {large * 1e3:.2f} ms per request")
    print(f"  per request, {args.large} / {args.small}: x{large / small:.2f} (same rounds' medians)")


if __name__ == "__main__":
    main()
