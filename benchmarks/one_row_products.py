"""One-row products (M = 1: a drafter's pass, a decode step without drafts) in an "aot-tuned"
package: the product as mtpkit computes it (layers/linear.linear: an mm of the column-major CPU
weight, which inductor's freezing turns into its C++ GEMM template, graphs/micro_gemm.py's loops)
against two one-row forms that bypass the template, each on a row-major copy of the weight folded
into the package's constants:

    mv   torch.mv(w, x[0])            inductor generates a reduction along w's rows
    wx   torch.mm(w, x.t()).t()       the weight first: not packed, MKL's plain GEMM (extern call)

and, for scale, mtpkit's product on bfloat16 copies of the weights (column-major too) and the row
cast to bfloat16 ("bf16": half the bytes; outputs within bfloat16's rounding, 2e-2, of mm's), which
a drafter could run in without changing what is generated (the target verifies every draft);
on two workloads, each compiled as an AOTInductor package under the mode's settings
(graphs/compiled._aot_options("aot-tuned"), the micro-GEMM patch) and timed in alternated rounds
(one thread; same-process ratios):

    pass    7 passes over the six products of tiny-qwen3-next's MTP pass (2.2 MB of weights,
            which stay in the L3 across passes on both machines measured)
    chain   6 RMSNorm -> gate/up -> SiLU-gate -> down blocks of width 256 / 512 (9.4 MB of
            weights, more than the AMD VM's 8 MB L3: every product streams from DRAM there, like a decode step
            of the whole model)

The one-row forms are not in mtpkit (docs/performance.md, "One-row products"): they win the
cache-resident workload and lose the streaming one (a whole generation with `mv` in every graph was
slower without drafts, 2026-12-03), and in the drafters' graphs alone, where the weights stay in the
cache, they did not make whole generations faster. That variant is commit ed4e6f7
(graphs/compiled.DRAFTER_GRAPHS, layers/linear.one_row_products), where `--generation` measures it:
per model, two "aot-tuned" engines at its best num_spec, one as that commit builds it and one whose
drafter graphs keep the mm (compiled with DRAFTER_GRAPHS empty, which names other packages), the same
8 held-out prompts x 128 tokens at batch 1 (bench_cpu's), alternated in rounds; tokens identical.

    python benchmarks/one_row_products.py
    git checkout ed4e6f7 && python benchmarks/one_row_products.py --generation   # qwen k=7, gemma4 k=3
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtpkit.graphs import compiled, micro_gemm  # noqa: E402
from mtpkit.layers.linear import linear  # noqa: E402

PASS_SHAPES = [(256, 768), (512, 256), (256, 265), (256, 257), (256, 256), (128, 256)]   # (in, out)
FORMS = ("mm", "mv", "wx", "bf16")


def product(x, w, form: str):
    if form == "bf16":
        return linear(x.to(w.dtype), w).float()
    if form == "mv":
        return torch.mv(w.contiguous(), x[0])[None]
    if form == "wx":
        return torch.mm(w.contiguous(), x.t()).t()
    return linear(x, w)


def _colmajor(k: int, n: int, g, form: str) -> torch.nn.Parameter:
    """[out n, in k] stored column-major, as layers/layout.set_weight_layout lays CPU weights out
    (in bfloat16 for the "bf16" form)."""
    w = torch.randn(k, n, generator=g) / k ** 0.5
    return torch.nn.Parameter((w.bfloat16() if form == "bf16" else w).t(), requires_grad=False)


class Pass(torch.nn.Module):
    def __init__(self, form: str, passes: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ws = torch.nn.ParameterList([_colmajor(k, n, g, form) for k, n in PASS_SHAPES])
        self.form, self.passes = form, passes

    def inputs(self):
        return tuple(torch.randn(1, k) for k, _ in PASS_SHAPES)

    def forward(self, *xs):
        out = []
        for p in range(self.passes):   # each pass's inputs differ, so nothing is shared between them
            out += [product(x + p, w, self.form) for x, w in zip(xs, self.ws)]
        return out


class Chain(torch.nn.Module):
    def __init__(self, form: str, layers: int = 6, hidden: int = 256, inter: int = 512):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.gu = torch.nn.ParameterList([_colmajor(hidden, 2 * inter, g, form) for _ in range(layers)])
        self.down = torch.nn.ParameterList([_colmajor(inter, hidden, g, form) for _ in range(layers)])
        self.form, self.hidden = form, hidden

    def inputs(self):
        return (torch.randn(1, self.hidden),)

    def forward(self, x):
        for gu, down in zip(self.gu, self.down):
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            g, u = product(xn, gu, self.form).chunk(2, -1)
            x = x + product(torch.nn.functional.silu(g) * u, down, self.form)
        return x


def package(module: torch.nn.Module, xs: tuple, path: Path):
    with torch.inference_mode(), micro_gemm.patched():
        exported = torch.export.export(module.eval(), xs, strict=False)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path),
                                                 inductor_configs=compiled._aot_options("aot-tuned"))
    return torch._inductor.aoti_load_package(str(path))


def timed(f, xs, reps: int) -> float:
    with torch.inference_mode():
        t = time.perf_counter()
        for _ in range(reps):
            f(*xs)
        return (time.perf_counter() - t) / reps


def generation(rounds: int, max_tokens: int) -> None:
    if not hasattr(compiled, "DRAFTER_GRAPHS"):
        sys.exit("--generation measures the drafter graphs' one-row form, which this checkout does not have: "
                 "run it at commit ed4e6f7 (git checkout ed4e6f7)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cpu import heldout_prompts, ratio, round_robin
    from mtpkit import LLM, SamplingParams
    print(f"torch {torch.__version__}; one thread; 8 held-out prompts x {max_tokens} tokens at batch 1, "
          f"aot-tuned; {rounds} rounds, engines alternated; ratio: the median of same-round ratios")
    prompts, sp = heldout_prompts(8, 64), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for model, k in (("tiny-qwen3-next", 7), ("tiny-gemma4", 3)):
        engines = {}
        for form, drafters in (("mv", compiled.DRAFTER_GRAPHS), ("mm", ())):
            before, compiled.DRAFTER_GRAPHS = compiled.DRAFTER_GRAPHS, drafters
            try:   # the engine compiles its graphs in its first generation (compile_after=0)
                llm = LLM(model, num_spec=k, dtype="float32", max_num_seqs=1, enable_prefix_caching=False,
                          compile="aot-tuned", compile_after=0)
                llm.runner.graphs.trace_after = 0
                llm.generate(prompts, sp)
            finally:
                compiled.DRAFTER_GRAPHS = before
            engines[form] = llm
        fns = {f: (lambda llm=llm: [llm.generate([p], sp)[0].token_ids for p in prompts])
               for f, llm in engines.items()}
        times, results = round_robin(fns, rounds)
        n = len(prompts) * max_tokens
        print(f"{model} num_spec={k}: identical tokens {results['mv'] == results['mm']}")
        for f in fns:
            print(f"  drafter graphs' one-row products {f}: {n / statistics.median(times[f]):8.1f} tok/s  "
                  f"x{ratio(times, f, 'mm'):.3f} the mm's speed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--generation", action="store_true", help="whole generations: mtpkit's drafter graphs with mv vs mm")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.generation:
        return generation(args.rounds, args.max_tokens)
    print(f"torch {torch.__version__}; one thread; AOTInductor packages, aot-tuned settings; "
          f"{args.rounds} rounds of {args.reps} calls, forms alternated")
    with tempfile.TemporaryDirectory() as tmp:
        for name, cls in (("pass", Pass), ("chain", Chain)):
            mods = {f: cls(f) for f in FORMS}
            xs = mods["mm"].inputs()
            runs = {f: package(m, xs, Path(tmp) / f"{name}-{f}.pt2") for f, m in mods.items()}
            with torch.inference_mode():
                want = mods["mm"](*xs)
                for f, r in runs.items():
                    got = r(*xs)
                    for a, b in zip(got if isinstance(got, (list, tuple)) else [got],
                                    want if isinstance(want, (list, tuple)) else [want]):
                        tol = 2e-2 if f == "bf16" else 1e-4
                        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
            for r in runs.values():
                timed(r, xs, args.reps)
            times = {f: [] for f in FORMS}
            ratios = {f: [] for f in FORMS}
            for _ in range(args.rounds):
                t = {f: timed(r, xs, args.reps) for f, r in runs.items()}
                for f in FORMS:
                    times[f].append(t[f])
                    ratios[f].append(t[f] / t["mm"])
            mb = sum(w.numel() * 4 for w in mods["mm"].parameters()) / 1e6
            print(f"{name} ({mb:.1f} MB of float32 weights; every form's outputs equal mm's within 1e-4, bf16's within 2e-2):")
            for f in FORMS:
                us = statistics.median(times[f]) * 1e6
                print(f"  {f:4s} {us:8.1f} us per call  x{statistics.median(ratios[f]):.2f} mm's time")


if __name__ == "__main__":
    main()
