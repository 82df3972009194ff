"""What one state snapshot's save after a verify step costs on the host (prefix caching: a
request's steps save its recurrent state once per block they cross; CacheTensors.
save_verify_snapshots), warm and right after a write over `--sweep-mb` MB (what a graph replay's
weight traffic leaves in the caches before the host work runs), and how many torch calls it
makes from Python. Median over `--saves` saves.

    python benchmarks/verify_snapshot_save.py
    PYTHONPATH=/path/to/other/tree python benchmarks/verify_snapshot_save.py   # another revision's
"""

import argparse
import statistics
import time

import torch

import mtpkit
from mtpkit import LLM


class _Calls(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=7)
    p.add_argument("--saves", type=int, default=300)
    p.add_argument("--sweep-mb", type=float, default=16.0)
    args = p.parse_args()
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=1, num_threads=1)
    cache = llm.runner.cache
    if not cache.state:
        raise SystemExit(f"{args.model} has no recurrent state: nothing to snapshot")
    bundle = args.num_spec + 1
    slots = list(range(1, bundle + 1))   # one request's bundle slots
    sweep = torch.zeros(int(args.sweep_mb * 2**20 / 4))
    print(f"mtpkit from {mtpkit.__file__}; {args.model} num_spec {args.num_spec}, {cache.num_snapshots} snapshot rows")
    with torch.inference_mode():
        cache.save_verify_snapshots([slots], [0], [0])   # (what a first save makes once)
        with _Calls() as calls:
            cache.save_verify_snapshots([slots], [0], [0])
        for label, swept in (("warm", False), (f"after a {args.sweep_mb:g} MB sweep", True)):
            times = []
            for i in range(args.saves):
                if swept:
                    sweep.add_(1.0)
                t = time.perf_counter()
                cache.save_verify_snapshots([slots], [i % bundle], [i % cache.num_snapshots])
                times.append(time.perf_counter() - t)
            print(f"  {label:24s} {statistics.median(times) * 1e6:7.1f} us per save")
    print(f"  torch calls from Python per save (after the first): {calls.n}")


if __name__ == "__main__":
    main()
