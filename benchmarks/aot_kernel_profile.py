"""Per-kernel time inside the aot-tuned verify and propose graphs (issue 32): which generated
kernels a compiled step spends its time in.

Builds the model (tiny-qwen3-next; `--model tiny-gemma4` with its assistant) with
LLM(compile="aot-tuned", compile_after=0) on its own package
directory, generates once (so the graphs of context 128 are compiled), resets the buffers to
inert rows, and replays the verify and propose graphs under torch.profiler; prints each
kernel's self time per replay. Run it with TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1, which
makes inductor's C++ kernels record themselves (a package built without it shows only the
extern calls): the packages then differ from the normal ones, hence their own directory.

    TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 python benchmarks/aot_kernel_profile.py --cache /tmp/kernel-profile
    TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 python benchmarks/aot_kernel_profile.py --cache /tmp/kprof-gemma \
        --model tiny-gemma4 --num-spec 3
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu import heldout_prompts  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", required=True, help="package directory of these (profiling) packages")
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--num-spec", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--prefill", action="store_true",
                   help="also profile whole prefill steps (a 64-token prompt, prefix cache off: its compiled "
                        "prefill and prefill-proposal graphs and the host work around them)")
    p.add_argument("--draft-dtype", default=None, help="the drafter's dtype (LLM(draft_dtype=...)); default the target's")
    args = p.parse_args()
    llm = LLM(args.model, num_spec=args.num_spec, dtype="float32", max_num_seqs=1, num_threads=1,
              compile="aot-tuned", compile_after=0, compile_cache_dir=args.cache, draft_dtype=args.draft_dtype,
              enable_prefix_caching=not args.prefill)
    g = llm.runner.graphs
    g.trace_after = 0
    llm.generate([heldout_prompts(1, 64)[0]], SamplingParams(max_tokens=40, ignore_eos=True))
    n, key = 1, (1, 128)
    g.buf.make_inert(n, g.bundle)
    verify_args = g._verify_args(n)
    graphs = [("verify", g.verify_graphs[key], verify_args)]
    if args.num_spec:
        hidden = g.verify_graphs[key](*verify_args)[0]
        graphs.append(("propose", g.propose_graphs[key], g._propose_args(n, hidden)))
    if args.prefill:
        prompt, one = heldout_prompts(1, 64)[0], SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([prompt], one)   # (the prefill's graphs compiled above, with the first prompt)
        graphs.append(("prefill step", lambda: llm.generate([prompt], one, use_tqdm=False), ()))
    for name, fn, a in graphs:
        for _ in range(20):
            fn(*a)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                fn(*a)
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        print(f"\n{name}: profiled self total {sum(e.self_cpu_time_total for e in rows) / 50:.1f} us/replay")
        for e in rows[:args.top]:
            print(f"  {e.key[:110]:110s} {e.count / 50:5.1f} {e.self_cpu_time_total / 50:8.1f} us")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
