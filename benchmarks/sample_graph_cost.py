"""The sample body alone (sampling/rejection.sampled_verify, what a verify step with random rows
replays after the verify graph), traced as CapturedSteps traces it, against the eager
`rejection_sample` on the same rows, warm, in one process: per call and as a ratio.

    python benchmarks/sample_graph_cost.py                 # 8 rows, bundle 4, tiny-qwen3-next's vocabulary
    python benchmarks/sample_graph_cost.py --rows 1 --bundle 8 --top-k 20 --top-p 0.9
"""

import argparse
import time
import warnings

import torch

from mtpkit import SamplingParams
from mtpkit.graphs.specialize import specialized
from mtpkit.sampling.rejection import rejection_sample, sampled_verify
from mtpkit.sampling.sampler import Filters, SamplingTensors, noise_steps, sampling_rows


def per_call(fn, reps: int) -> float:
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--bundle", type=int, default=4)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    n, B, V = args.rows, args.bundle, args.vocab
    params = [SamplingParams(temperature=0.8, top_k=args.top_k, top_p=args.top_p)] * n
    seeds = list(range(1, n + 1))
    fl, it = sampling_rows(params, seeds)
    floats, ints = torch.tensor(fl, dtype=torch.float32), torch.tensor(it)
    filters = Filters.of(params)._replace(greedy=True)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, B, V, generator=g)
    drafts, limit = torch.randint(0, V, (n, B - 1), generator=g), torch.full((n,), B - 1)
    positions = (torch.arange(B) + 50).repeat(n, 1)   # every row samples positions 50..50+B-1

    def body(lg, dr, lim, fl_, it_, pos, steps):
        return sampled_verify(lg, lg, dr, lim, SamplingTensors.from_buffers(fl_, it_, filters), it_[2], pos, steps)
    inputs = (logits, drafts, limit, floats, ints, positions, noise_steps(V, "cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = specialized(torch.jit.trace(body, inputs, check_trace=False), "sample")
    st = SamplingTensors.from_params(params, "cpu")
    assert torch.equal(traced(*inputs)[:, :B], rejection_sample(logits, drafts, limit, st, seeds, [50] * n)[0])
    t_graph = per_call(lambda: traced(*inputs), args.reps)
    t_eager = per_call(lambda: rejection_sample(logits, drafts, limit, st, seeds, [50] * n), args.reps)
    print(f"{n} rows x bundle {B} x vocab {V}, temperature 0.8, top_k {args.top_k}, top_p {args.top_p}, one thread, warm:")
    print(f"  traced sample body   {t_graph:8.1f} us a call")
    print(f"  eager rejection      {t_eager:8.1f} us a call")
    print(f"  traced / eager       x{t_graph / t_eager:.3f}")


if __name__ == "__main__":
    main()
