"""Inductor's float32 C++ GEMM micro-kernel as torch renders it vs as mtpkit/graphs/micro_gemm.py
patches it (plain loops, packed weights prefetched), at decode shapes: M = 1..8 rows times the
embedded models' weight shapes, each in a module of `--layers` distinct frozen weights (more bytes
than the last-level cache, as a decode step's weights are), compiled the way "freeze" /
"aot-tuned" compile (freezing, max-autotune, the C++ template only), one thread. The two
compiled modules run alternately in rounds; the table gives each one's weight bandwidth (GB/s,
median round) and their same-round ratio, and checks that the outputs are bit-identical.

    python benchmarks/micro_gemm.py
    python benchmarks/micro_gemm.py --m 4 --shapes 256x1289 --rounds 15
"""

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtpkit.graphs import micro_gemm  # noqa: E402

# (K, N) of the embedded models' decode matmuls: tiny-qwen3-next's merged MoE input, MoE down
# (shared + experts), GDN in_proj, attention qkv, out projections.
SHAPES = ["256x1289", "640x256", "256x648", "256x768", "256x256"]


class Weights(torch.nn.Module):
    def __init__(self, K: int, N: int, layers: int):
        super().__init__()
        # Column-major [N, K] as mtpkit stores linear weights on CPU (layers/layout.py).
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(N, K).t().contiguous().t(),
                                                             requires_grad=False) for _ in range(layers)])

    def forward(self, x):
        return [torch.mm(x, w.t()) for w in self.ws]


def compiled(mod, x, patch: bool):
    """mod compiled on its own (dynamo keeps one entry per module instance: never reset between
    the two, which would recompile the first under default settings at its next call)."""
    opts = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP", "fx_graph_cache": False}
    with torch.inference_mode(), torch._inductor.config.patch(opts), \
            (micro_gemm.patched() if patch else contextlib.nullcontext()):
        fn = torch.compile(mod, fullgraph=True, dynamic=False)
        fn(x)
    return fn


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--bytes", type=float, default=24e6, help="weight bytes per module (above the LLC)")
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}; patch applies: {micro_gemm.patch_applies()}; one thread; "
          f"{args.bytes / 1e6:.0f} MB of weights per module; {args.rounds} rounds")
    print(f"{'M':>3} {'K x N':>10} {'torch GB/s':>11} {'patched GB/s':>13} {'x':>6}  equal")
    ratios = []
    for shape in args.shapes:
        K, N = map(int, shape.split("x"))
        layers = max(2, int(args.bytes / (K * N * 4)))
        mod = Weights(K, N, layers).eval()
        for M in args.m:
            x = torch.randn(M, K)
            torch._dynamo.reset()   # a fresh cache per shape: two module instances, one entry each
            fns = {"torch": compiled(mod, x, False), "patched": compiled(copy.deepcopy(mod), x, True)}
            with torch.inference_mode():
                equal = all(torch.equal(a, b) for a, b in zip(fns["torch"](x), fns["patched"](x)))
                times = {k: [] for k in fns}
                for _ in range(args.rounds):
                    for k, fn in fns.items():
                        t = time.perf_counter()
                        fn(x)
                        times[k].append((time.perf_counter() - t) / layers)
            gbs = {k: K * N * 4 / statistics.median(v) / 1e9 for k, v in times.items()}
            r = statistics.median(a / b for a, b in zip(times["torch"], times["patched"]))
            ratios.append(r)
            print(f"{M:>3} {shape:>10} {gbs['torch']:>11.1f} {gbs['patched']:>13.1f} {r:>6.2f}  {equal}")
    print(f"median ratio (torch time / patched time): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
