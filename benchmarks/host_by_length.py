"""A verify step's host work by how long the output already is (a stream's per-step cost must
not grow with it): one long greedy generation at batch 1, one thread, CPU graphs traced; per
step, its cycle (one stream event to the next) less its graph replays, median per eighth of the
output, and the last eighth's against the first's (the same run: its own baseline).

    python benchmarks/host_by_length.py                     # tiny-qwen3-next, num_spec 0, 2000 tokens
    python benchmarks/host_by_length.py --num-spec 3 --read-outputs   # reading every event's output
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_cpu import heldout_prompts  # noqa: E402
from graph_clock import GraphClock, graphs_of, replace_graphs  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--read-outputs", action="store_true", help="read every event's output (StreamEvent.output)")
    args = p.parse_args()
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=1, num_threads=1,
              enable_prefix_caching=False)
    llm.runner.graphs.trace_after = 0
    prompt, sp = heldout_prompts(1, 32), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for _ in llm.stream(prompt, sp):   # every graph this generation replays, traced
        pass
    clock = GraphClock()
    replace_graphs(llm.runner.graphs, graphs_of(llm.runner.graphs), lambda key, fn: clock.timed(fn))
    host, tokens = [], []
    t, before = time.perf_counter(), clock.seconds
    for ev in llm.stream(prompt, sp):
        if args.read_outputs:
            ev.output
        now = time.perf_counter()
        host.append((now - t - (clock.seconds - before)) * 1e6)
        tokens.append(len(ev.new_token_ids))
        t, before = now, clock.seconds
    host, tokens = host[1:], tokens[1:]   # (the first event's cycle is the prefill's)
    print(f"host work per verify step by output length (median us), {args.model} num_spec {args.num_spec}, "
          f"{args.max_tokens} tokens at batch 1, one thread, traced{', every output read' if args.read_outputs else ''}:")
    eighth = max(1, len(host) // 8)
    done, medians = 0, []
    for a in range(0, len(host) - eighth + 1, eighth):
        medians.append(statistics.median(host[a:a + eighth]))
        print(f"  output tokens {done:5d}..{done + sum(tokens[a:a + eighth]):5d}: host {medians[-1]:7.1f} us")
        done += sum(tokens[a:a + eighth])
    print(f"  last eighth / first eighth: x{medians[-1] / medians[0]:.3f} (1.0: a step's host work does not grow "
          "with the output)")


if __name__ == "__main__":
    main()
