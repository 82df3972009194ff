"""What recurrent-state snapshots cost a prefill (docs/design.md, "State snapshots"): the
target's prefill of one long prompt (the model forward, as ModelRunner.prefill_hidden runs
it), three ways, on one engine, in alternating rounds (the machine is noisy):

- plain:    one chunk, no snapshot;
- in-chunk: one chunk writing a snapshot every `--every` tokens (metadata.StateSnapshots);
- split:    chunks of `--every` tokens, each followed by CacheTensors.save_snapshots (what a
            prefix cache does without in-chunk snapshots: a step per snapshot).

Prints each way's median time and the ratios to plain (median over rounds of the same-round
ratio). The drafter's work and the scheduler's per step are not included (they add to the
split way's cost in an engine).

    python benchmarks/state_snapshots.py
    python benchmarks/state_snapshots.py --tokens 1500 --every 64 --rounds 5
"""

import argparse
import statistics
import time

import torch

from mtpkit import LLM
from mtpkit.step.cache import allocate_snapshots
from mtpkit.step.metadata import PrefillChunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3-next")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--every", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    llm = LLM(args.model, max_model_len=args.tokens + 64, enforce_eager=True)
    runner, cache, ecfg = llm.runner, llm.cache, llm.engine_config
    n_snap = args.tokens // args.every
    spec = type(llm.model).cache_spec(llm.model_config, num_spec=ecfg.bundle - 1)
    cache.snapshots = allocate_snapshots(spec, n_snap + 1, llm.dtype, llm.device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, llm.model_config.vocab_size, (args.tokens,), generator=g).tolist()
    # The engine is idle: blocks 1.. and slots 1..bundle are free, used directly.
    block_ids = [list(range(1, 2 + args.tokens // ecfg.block_size)) for _ in cache.pool_windows]
    slots = list(range(1, 1 + ecfg.bundle))

    def chunk(start, end):
        return PrefillChunk(prompt[start:end], start, block_ids, slots)

    def plain():
        runner.prefill_hidden([chunk(0, args.tokens)])

    def in_chunk():
        runner.prefill_hidden([chunk(0, args.tokens)],
                              [(0, (i + 1) * args.every - 1, i) for i in range(n_snap)])

    def split():
        for i, start in enumerate(range(0, args.tokens, args.every)):
            end = min(start + args.every, args.tokens)
            runner.prefill_hidden([chunk(start, end)])
            if end % args.every == 0:
                cache.save_snapshots([slots], [i])

    ways = {"plain": plain, "in-chunk": in_chunk, "split": split}
    times = {k: [] for k in ways}
    with torch.inference_mode():
        for f in ways.values():   # warm-up
            f()
        for _ in range(args.rounds):
            for k, f in ways.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    print(f"{args.model}: prefill of {args.tokens} tokens, a snapshot every {args.every} ({n_snap}), "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}")
    for k in ways:
        ratio = statistics.median(t / p for t, p in zip(times[k], times["plain"]))
        print(f"  {k:9s} {statistics.median(times[k]) * 1e3:8.1f} ms   x plain {ratio:5.2f}")
    print(f"  snapshot bytes: {cache.bytes_per_snapshot} each (= one state slot; {llm.dtype}, "
          f"num_spec {ecfg.bundle - 1})")


if __name__ == "__main__":
    main()
