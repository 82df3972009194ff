"""Which layout and kernel a CPU linear layer (y = x W^T, no bias) should use at M = 1..32 rows
(issue 32, item 3a): measured at the embedded models' shapes and a few real-model shapes.

Variants, all float32, one thread:
- `F.linear`: W row-major [N, K] (as loaded);
- `mm(x, Wt)`: torch.mm on W^T stored contiguous [K, N] (W column-major: what
  mtpkit/layers/layout.py stores on CPU and layers/linear.py's `linear` runs);
- `mm(x, W.t())`: torch.mm on the transposed view of a row-major W;
- `addmm(0, x, Wt)`: torch.addmm with a zero bias on the contiguous W^T;
- `mkl packed`: torch.ops.mkl._mkl_linear on a weight packed for MKL's sgemm once
  (`_mkl_reorder_linear_weight`, what inductor's weight prepacking uses for fp32);
- `mkldnn`: torch.ops.mkldnn._linear_pointwise on a oneDNN-reordered weight.

Every variant runs in each round, interleaved (the machine is shared, its clock moves); each
prints its median time over rounds and its ratio to `mm(x, Wt)` (median of the per-round
ratios). The exactness column is the largest difference to `mm(x, Wt)` (0: bit-identical).

    python benchmarks/linear_layouts.py                   # embedded and real shapes, M 1 2 4 8 16 32
    python benchmarks/linear_layouts.py --shapes embedded --m 1 4 8
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (name, K = in_features, N = out_features)
EMBEDDED = [
    ("qwen gdn in_proj", 256, 648), ("qwen attn qkv", 256, 768), ("qwen moe w_in", 256, 265),
    ("qwen experts w13 (dense)", 256, 1024), ("qwen moe w_out", 640, 256), ("qwen lm_head", 256, 257),
    ("gemma qkv", 256, 384), ("gemma mlp gate_up", 256, 1024), ("gemma mlp down", 512, 256),
    ("256 x 256 (o_proj, out_proj)", 256, 256),
]
REAL = [
    ("Qwen3-Next-80B o_proj", 4096, 2048), ("Qwen3-Next-80B expert gate_up", 2048, 1024),
    ("Gemma 4 E2B q_proj", 1536, 2048),
]


def variants(w: torch.Tensor, m: int) -> dict:
    wt = w.t().contiguous()
    zero = torch.zeros(w.shape[0])
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    dnn = torch.ops.mkldnn._reorder_linear_weight(w, m)
    return {
        "mm(x, Wt)": lambda x: torch.mm(x, wt),
        "F.linear": lambda x: F.linear(x, w),
        "mm(x, W.t())": lambda x: torch.mm(x, w.t()),
        "addmm(0, x, Wt)": lambda x: torch.addmm(zero, x, wt),
        "mkl packed": lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, m),
        "mkldnn": lambda x: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], ""),
    }


def run(shape, m: int, rounds: int, budget_s: float) -> dict:
    name, K, N = shape
    torch.manual_seed(0)
    w, x = torch.randn(N, K) / K ** 0.5, torch.randn(m, K)
    fns = variants(w, m)
    ref = fns["mm(x, Wt)"](x)
    diff = {k: (f(x) - ref).abs().max().item() for k, f in fns.items()}
    t0 = time.perf_counter()
    for f in fns.values():
        f(x)
    reps = max(3, min(400, int(budget_s / rounds / len(fns) / max(time.perf_counter() - t0, 1e-6) * len(fns))))
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                f(x)
            times[k].append((time.perf_counter() - t) / reps * 1e6)
    base = times["mm(x, Wt)"]
    return {k: (statistics.median(v), statistics.median(a / b for a, b in zip(v, base)), diff[k])
            for k, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=["embedded", "real", "all"], default="all")
    p.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--budget", type=float, default=0.3, help="seconds per (shape, M)")
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes = {"embedded": EMBEDDED, "real": REAL, "all": EMBEDDED + REAL}[args.shapes]
    print(f"threads={torch.get_num_threads()}, {args.rounds} interleaved rounds; "
          "us (median), ratio to mm(x, Wt) (median of per-round ratios), max |diff| to mm(x, Wt)")
    wins = {}
    for shape in shapes:
        for m in args.m:
            res = run(shape, m, args.rounds, args.budget)
            cells = "  ".join(f"{k} {us:7.1f} x{r:4.2f}{'' if d == 0 else f' d={d:.0e}'}"
                              for k, (us, r, d) in res.items())
            best = min(res, key=lambda k: res[k][1])
            wins[best] = wins.get(best, 0) + 1
            print(f"{shape[0]:30s} K={shape[1]:5d} N={shape[2]:5d} M={m:3d}: {cells}  best {best}")
    print("\nfastest variant (by median ratio), cases won:", ", ".join(f"{k} {n}" for k, n in wins.items()))


if __name__ == "__main__":
    main()
