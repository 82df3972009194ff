"""The MoE block's dense and gather paths at small M (issue 32, item 3): SparseMoE's `_dense`
(every expert: three matmuls) and `_sparse` (the chosen experts' blocks gathered, batched
matmuls), each traced, with w13 column-major (the CPU layout of a matrix that only multiplies)
and row-major (each expert's [2I, hidden] block contiguous), at the embedded model's MoE
shape and a larger one (128 experts, top 8). float32, one thread, the four variants
interleaved in rounds; ratios to the dense path with column-major w13 (median of per-round
ratios); d: the largest difference to it.

`--merged` instead times the whole block (forward, traced) at the embedded shape with
w_in and w13 merged into one matmul (SparseMoE.merge_for_cpu) against the two matmuls.

    python benchmarks/moe_paths.py
`--grouped` times the eager block (forward, as a prefill runs it) at many tokens, computing
every expert (`_dense`) against looping over the experts hit (`_grouped`), at both shapes:
where the loop starts to pay sets SparseMoE.grouped_rows.

`--one-token` times the compiled one-token expert products (moe_experts' compiled form: the
proposal's MoE, 2 of 8 experts) under torch.compile, 24 layers' distinct weights per call (beyond
the L3 cache, as in a step): gate/up blocks read from the column-major merged matrix (what
merge_for_cpu leaves), from a row-major copy, and as batched matmuls on the gathered blocks.

    python benchmarks/moe_paths.py --merged
    python benchmarks/moe_paths.py --grouped
    python benchmarks/moe_paths.py --one-token
"""

import argparse
import statistics
import time
import warnings

import torch

from mtpkit.layers.layout import set_weight_layout
from mtpkit.layers.moe import SparseMoE
from mtpkit.parallel import TP

SHAPES = [(8, 2, 64, 128, 256), (128, 8, 256, 256, 1024)]   # experts, top k, I, shared I, hidden


def merged_vs_unmerged(rounds: int = 15, reps: int = 100):
    E, K, I, S, H = SHAPES[0]
    ms = {}
    for name, merge in (("unmerged", False), ("merged", True)):
        m = SparseMoE(H, E, K, I, S, True, TP.single())
        torch.manual_seed(0)
        for p in m.parameters():
            p.data = torch.randn_like(p) * 0.05
        m.merge_inputs = merge
        set_weight_layout(m, torch.device("cpu"), lambda n: False)
        ms[name] = m
    for T in (1, 4, 8):
        x = torch.randn(T, H)
        with torch.inference_mode():
            fns = {n: torch.jit.trace(m, (x,), check_trace=False) for n, m in ms.items()}
            d = (fns["merged"](x) - fns["unmerged"](x)).abs().max().item()
            ts = {n: [] for n in fns}
            for _ in range(rounds):
                for n, f in fns.items():
                    t = time.perf_counter()
                    for _ in range(reps):
                        f(x)
                    ts[n].append((time.perf_counter() - t) / reps * 1e6)
            r = statistics.median(a / b for a, b in zip(ts["merged"], ts["unmerged"]))
            print(f"E={E} K={K} I={I} H={H} T={T}: unmerged {statistics.median(ts['unmerged']):.1f} us  "
                  f"merged {statistics.median(ts['merged']):.1f} us  merged/unmerged x{r:.3f}  d={d:.0e}")


def dense_vs_grouped(rounds: int = 7):
    for E, K, I, S, H in SHAPES:
        m = SparseMoE(H, E, K, I, S, True, TP.single())
        torch.manual_seed(0)
        for p in m.parameters():
            p.data = torch.randn_like(p) * 0.05
        set_weight_layout(m, torch.device("cpu"), lambda n: n in m.row_major_params())
        m.merge_for_cpu()
        for T in (16, 32, 64, 128, 256):
            x = torch.randn(T, H)
            ts = {"dense": [], "grouped": []}
            with torch.inference_mode():
                outs = {}
                for _ in range(rounds):
                    for path, limit, rows in (("dense", 1 << 62, 1 << 62), ("grouped", 0, 0)):
                        m.dense_limit, m.grouped_rows = limit, rows
                        reps = max(1, 2048 // T) if E == 8 else 2
                        t = time.perf_counter()
                        for _ in range(reps):
                            outs[path] = m(x)
                        ts[path].append((time.perf_counter() - t) / reps * 1e6)
            d = (outs["grouped"] - outs["dense"]).abs().max().item()
            r = statistics.median(a / b for a, b in zip(ts["grouped"], ts["dense"]))
            print(f"E={E} K={K} I={I} H={H} T={T} ({T * K / E:.0f} pairs per expert): dense "
                  f"{statistics.median(ts['dense']):8.1f} us  grouped {statistics.median(ts['grouped']):8.1f} us  "
                  f"grouped/dense x{r:.2f}  d={d:.0e}")


def one_token_compiled(rounds: int = 7, reps: int = 100, layers: int = 24):
    from mtpkit.kernels.elementwise import ACTIVATIONS
    E, K, I, S, H = SHAPES[0]
    torch.manual_seed(0)
    lay = []
    for _ in range(layers):
        merged = torch.randn(E + 1 + 2 * S + E * 2 * I, H).t().contiguous().t()   # column-major, as merged
        w_out = torch.randn(H, S + E * I).t().contiguous().t()
        w13 = merged[E + 1 + 2 * S:].view(E, 2 * I, H)
        lay.append((w13, w13.contiguous(), w_out[:, S:].T.view(E, I, H)))

    def body(form):
        def f(x, local, weights):
            acc = x
            for w13c, w13r, down in lay:
                w13 = w13r if form == "row-major sum" else w13c
                xs = acc.repeat_interleave(K, dim=0)
                if form == "bmm":
                    gu = torch.bmm(w13.index_select(0, local), xs[:, :, None])[:, :, 0]
                else:
                    gu = (w13.index_select(0, local) * xs[:, None, :]).sum(-1)
                g, u = gu.chunk(2, dim=1)
                a = ACTIVATIONS["silu"](g) * u * weights.reshape(K, 1)
                if form == "bmm":
                    y = torch.bmm(a[:, None, :], down.index_select(0, local))[:, 0]
                else:
                    y = (a[:, :, None] * down.index_select(0, local)).sum(1)
                acc = acc + 1e-6 * y.sum(0, keepdim=True)
            return acc
        return f
    x, local, w = torch.randn(1, H) * 0.01, torch.tensor([3, 6]), torch.rand(1, K)
    forms = ["column-major sum", "row-major sum", "bmm"]
    fns = {k: torch.compile(body(k), fullgraph=True) for k in forms}
    with torch.inference_mode():
        outs = {k: f(x, local, w) for k, f in fns.items()}
        ts = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                for _ in range(10):
                    f(x, local, w)
                t = time.perf_counter()
                for _ in range(reps):
                    f(x, local, w)
                ts[k].append((time.perf_counter() - t) / reps / layers * 1e6)
    base = ts[forms[0]]
    print(f"E={E} K={K} I={I} H={H}, one token, compiled, per layer: " + "  ".join(
        f"{k} {statistics.median(v):.1f} us x{statistics.median(a / b for a, b in zip(v, base)):.2f} "
        f"d={(outs[k] - outs[forms[0]]).abs().max().item():.0e}" for k, v in ts.items()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--merged", action="store_true")
    p.add_argument("--grouped", action="store_true")
    p.add_argument("--one-token", action="store_true")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if args.merged:
        return merged_vs_unmerged()
    if args.grouped:
        return dense_vs_grouped()
    if args.one_token:
        return one_token_compiled()
    for (E, K, I, S, H) in SHAPES:
        ms = {}
        for lay in ("w13 column-major", "w13 row-major"):
            m = SparseMoE(H, E, K, I, S, True, TP.single())
            torch.manual_seed(0)
            for p in m.parameters():
                p.data = torch.randn_like(p) * 0.05
            keep = (lambda n: False) if lay.endswith("column-major") else (lambda n: n == "w13")
            m.merge_inputs = False   # the dense path's own two matmuls, in both layouts
            m.row_major_params = lambda: ()
            set_weight_layout(m, torch.device("cpu"), keep)
            ms[lay] = m
        for T in [1, 2, 4, 8]:
            x = torch.randn(T, H)
            with torch.inference_mode():
                h = ms["w13 row-major"].project_in(x)
                fns = {f"{p} {lay}": torch.jit.trace(lambda x, h, p=p, m=m: getattr(m, p)(x, h), (x, h),
                                                     check_trace=False)
                       for lay, m in ms.items() for p in ("_dense", "_sparse")}
                ref = fns["_dense w13 column-major"](x, h)
                reps = 100 if E == 8 else 5
                ts = {p: [] for p in fns}
                for _ in range(5):
                    for p, f in fns.items():
                        t = time.perf_counter()
                        for _ in range(reps):
                            f(x, h)
                        ts[p].append((time.perf_counter() - t) / reps * 1e6)
                base = ts["_dense w13 column-major"]
                print(f"E={E} K={K} I={I} H={H} T={T}: " + "  ".join(
                    f"{p} {statistics.median(v):8.1f} us x{statistics.median(a / b for a, b in zip(v, base)):.2f} "
                    f"d={(fns[p](x, h) - ref).abs().max().item():.0e}" for p, v in ts.items()))


if __name__ == "__main__":
    main()
