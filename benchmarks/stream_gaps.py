"""Per-stream token timing under many concurrent streams: cooperative stepping that waits for
another caller's step (Engine.advance, what LLM.stream does) vs each stream stepping the
engine itself under its lock (the engine loop before issue 30's follow-up: `step`).

N threads each stream one prompt (all started together) on one LLM. Per token: the gap since
the stream's previous token arrived (a burst of k tokens in one event counts one gap and k - 1
gaps of 0), time to first token from the start, and each way's total throughput. After a
warm-up, `--rounds` rounds run both ways once each, alternating which goes first (a noisy
stretch of a shared machine hits both alike); prints medians over rounds, the same-round
throughput ratio (advance / step), the mean step time (no design reports tokens more often
than once per step), the share of the steps advancing a stream at which it reported tokens
(with drafts a step emits several tokens at once: zero gaps that are not bursts), and checks that both ways produce the same tokens (greedy).

    python benchmarks/stream_gaps.py --streams 8 32
    python benchmarks/stream_gaps.py --model tiny-gemma4 --num-spec 3 --streams 8 32 --rounds 3
"""

import argparse
import statistics
import threading
import time

from mtpkit import LLM, SamplingParams

WORDS = ["def fibonacci(n):", "class Stack:", "import os\n", "for k in range(", "while True:", "try:\n",
         "x = [i for i in", "with open("]


def run(llm, prompts, params, way: str):
    """Stream every prompt on a thread of its own; returns tokens, per-token gaps, ttfts, wall time,
    mean step time, and the share of the steps that advanced a stream's request at which the
    stream reported tokens (1: at every step; below 1: steps' tokens reported together)."""
    engine = llm.engine
    if way == "step":
        engine.advance = engine.step   # the old loop: every stream steps itself, under the lock
    tokens, gaps, ttft, events = [None] * len(prompts), [], [], {}
    lock, go = threading.Lock(), threading.Barrier(len(prompts) + 1)

    def caller(i):
        go.wait()
        t0 = prev = time.perf_counter()
        got, mine, n = [], [], 0
        for ev in llm.stream(prompts[i], params):
            if ev.new_token_ids:
                n += 1
                now = time.perf_counter()
                if not got:
                    ttft_i = now - t0
                mine += [now - prev] + [0.0] * (len(ev.new_token_ids) - 1)
                prev = now
                got += ev.new_token_ids
        tokens[i] = got
        with lock:
            events[ev.output.request_id] = n
            gaps.extend(mine[1:])   # the first is the time to first token
            ttft.append(ttft_i)
    ths = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for th in ths:
        th.start()
    steps = engine.step_log.num_steps
    go.wait()
    t0 = time.perf_counter()
    for th in ths:
        th.join()
    wall = time.perf_counter() - t0
    if way == "step":
        del engine.advance
    recs = [r for r in engine.step_log.records() if r.index >= steps]
    step_ms = statistics.mean(r.end - r.start for r in recs) * 1e3
    # steps that emitted tokens for each request (a non-final prefill chunk emits none)
    emitting = [r for r in recs if r.num_tokens]
    at_steps = sum(events.values()) / sum(len(set(r.request_ids) & events.keys()) for r in emitting)
    return tokens, gaps, ttft, wall, step_ms, at_steps


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    llm = LLM(a.model, num_spec=a.num_spec, max_num_seqs=max(a.streams), max_model_len=256)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    print(f"{a.model} num_spec={a.num_spec} max_tokens={a.max_tokens} rounds={a.rounds}")
    for n in a.streams:
        prompts = [f"{WORDS[i % len(WORDS)]} {i}" for i in range(n)]
        want = run(llm, prompts, params, "advance")[0]   # warm-up (CPU traces), both ways
        assert run(llm, prompts, params, "step")[0] == want
        res = {"step": [], "advance": []}
        ratios = []
        for r in range(a.rounds):
            order = ["step", "advance"] if r % 2 == 0 else ["advance", "step"]
            same = {}
            for way in order:
                out = run(llm, prompts, params, way)
                assert out[0] == want, f"{way}: tokens differ"
                res[way].append(out)
                same[way] = out[3]
            ratios.append(same["step"] / same["advance"])   # throughput: advance / step
        print(f"  {n} streams:")
        for way, label in (("step", "before (each stream steps)"), ("advance", "after (wait for the step)")):
            rs = res[way]
            med = lambda f: statistics.median(f(x) for x in rs)   # noqa: E731 - median over rounds
            print(f"    {label:28s} gap median {med(lambda x: statistics.median(x[1])) * 1e3:6.1f} ms  "
                  f"p99 {med(lambda x: pct(x[1], 0.99)) * 1e3:6.1f} ms  "
                  f"zero gaps (burst) {med(lambda x: sum(g == 0 for g in x[1]) / len(x[1])):5.1%}  "
                  f"ttft median {med(lambda x: statistics.median(x[2])) * 1e3:6.1f} ms  "
                  f"p99 {med(lambda x: pct(x[2], 0.99)) * 1e3:6.1f} ms  "
                  f"{n * a.max_tokens / med(lambda x: x[3]):7.1f} tok/s  step {med(lambda x: x[4]):5.1f} ms  "
                  f"reported at {med(lambda x: x[5]):5.1%} of its steps")
        print(f"    throughput ratio (after / before, median of same-round ratios): {statistics.median(ratios):.3f}")
    print("  outputs identical: yes")


if __name__ == "__main__":
    main()
