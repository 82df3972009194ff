"""The cost of refusing non-finite weights at load (checkpoint/loader.py non_finite_count).

Loads each embedded model with the check and with it stubbed out, alternated in rounds (the
machine is noisy), and prints the median load-time ratio; then the check alone over 1 GiB of
bf16 and of fp32 weights, as seconds per GiB, to size it for a real checkpoint.

    python benchmarks/load_check.py --rounds 7
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mtpkit.checkpoint.loader as loader  # noqa: E402
from mtpkit import LLM  # noqa: E402


def load_time(model: str, check: bool) -> float:
    real = loader.non_finite_count
    if not check:
        loader.non_finite_count = lambda t: 0
    try:
        t0 = time.perf_counter()
        LLM(model, enforce_eager=True).close()
        return time.perf_counter() - t0
    finally:
        loader.non_finite_count = real


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--models", nargs="+", default=["tiny-qwen3-next", "tiny-gemma4"])
    args = p.parse_args(argv)
    for model in args.models:
        load_time(model, True)   # warm the file cache
        ratios = []
        for _ in range(args.rounds):
            on, off = load_time(model, True), load_time(model, False)
            ratios.append(on / off)
        print(f"{model}: load with the check / without: {statistics.median(ratios):.3f}x "
              f"(median of {args.rounds} rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    for dtype in (torch.bfloat16, torch.float32):
        t = torch.randn((1 << 30) // dtype.itemsize // 4096, 4096).to(dtype)
        loader.non_finite_count(t)
        t0 = time.perf_counter()
        loader.non_finite_count(t)
        print(f"the check alone over 1 GiB of {dtype}: {time.perf_counter() - t0:.3f} s on {torch.get_num_threads()} "
              "threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
