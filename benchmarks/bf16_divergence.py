"""How often bf16 speculation changes greedy output, where, and what a bundle-invariant path costs.

A verify step computes a bundle of num_spec + 1 tokens per request through GEMMs of another
shape than a one-token decode step, so in bf16 the roundings differ and a near-tie between the
two likeliest tokens can flip. This measures it on the embedded models: held-out prompts, greedy,
num_spec 0 vs each --specs value (the same prompts in the same batches), per family:
- how many prompts diverge, at which generated position first, and the logit margin there (the
  num_spec=0 engine's top-1 minus top-2 logit at that position, in its own bf16 forward);
- the same in fp32 (a control: it must be identical);
- with --invariant, again with every bf16 matmul computed in fp32 and rounded once (a
  bundle-invariant path: fp32 GEMMs give each row the same result whatever the row count on
  these CPUs, which the fp32 control checks), and its cost: the time of the num_spec=k run with
  the invariant matmuls over the plain one, in the same process, alternated in rounds.

    python benchmarks/bf16_divergence.py                       # 64 prompts x 256 tokens, specs 3 5
    python benchmarks/bf16_divergence.py --prompts 8 --tokens 64 --invariant
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtpkit import LLM, SamplingParams  # noqa: E402


def heldout_prompts(n: int, length: int) -> list[list[int]]:
    from training.corpus import encode_bytes, heldout_documents
    out = []
    for _, data in heldout_documents():
        for start in range(0, len(data) - 4 * length, max(len(data) // 4, 1)):
            ids = encode_bytes(data[start:start + length])
            if len(ids) == length:
                out.append(ids)
            if len(out) == n:
                return out
    raise SystemExit(f"only {len(out)} prompts of {length} tokens")


@contextlib.contextmanager
def fp32_matmuls():
    """Every bf16 matmul (mm, bmm, matmul, linear, @) computed in fp32 and rounded to bf16 once."""
    originals = {name: getattr(torch, name) for name in ("mm", "bmm", "matmul")}
    linear, tmatmul = F.linear, torch.Tensor.__matmul__

    def up(fn):
        def run(a, b, *rest, **kw):
            if a.dtype == torch.bfloat16:
                return fn(a.float(), b.float(), *[r.float() if isinstance(r, torch.Tensor) else r for r in rest],
                          **kw).to(torch.bfloat16)
            return fn(a, b, *rest, **kw)
        return run
    try:
        for name, fn in originals.items():
            setattr(torch, name, up(fn))
        F.linear = up(linear)
        torch.Tensor.__matmul__ = up(tmatmul)
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
        F.linear = linear
        torch.Tensor.__matmul__ = tmatmul


def run(model: str, num_spec: int, dtype: str, prompts, tokens: int, invariant: bool = False):
    ctx = fp32_matmuls() if invariant else contextlib.nullcontext()
    with ctx:
        llm = LLM(model, num_spec=num_spec, dtype=dtype, max_num_seqs=8, max_model_len=len(prompts[0]) + tokens + 8)
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))     # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        elapsed = time.perf_counter() - t0
    return llm, [o.token_ids for o in outs], elapsed


def compare(ref_llm, prompts, ref, other):
    """(prompt index, first diverging position, margin there) for every prompt that diverges."""
    found = []
    for i, (a, b) in enumerate(zip(ref, other)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        logits = ref_llm.score(prompts[i] + a[:j])[-1]
        top = torch.topk(logits, 2).values
        found.append((i, j, float(top[0] - top[1])))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny-qwen3-next", "tiny-gemma4"])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--specs", type=int, nargs="+", default=[3, 5])
    p.add_argument("--invariant", action="store_true", help="also the fp32-matmul (bundle-invariant) path")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds of the invariant path's cost")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    print(f"{len(prompts)} prompts x {args.tokens} tokens, greedy, batches of 8; torch {torch.__version__}")
    for model in args.models:
        for dtype in ("float32", "bfloat16"):
            ref_llm, ref, _ = run(model, 0, dtype, prompts, args.tokens)
            for k in args.specs:
                _, out, _ = run(model, k, dtype, prompts, args.tokens)
                d = compare(ref_llm, prompts, ref, out)
                where = ", ".join(f"#{i}@{j} (margin {m:.3g})" for i, j, m in d) or "-"
                print(f"{model:<16} {dtype:<9} num_spec={k}: {len(d)}/{len(prompts)} prompts diverge; {where}")
        if args.invariant:
            ref_llm, ref, _ = run(model, 0, "bfloat16", prompts, args.tokens, invariant=True)
            for k in args.specs:
                _, out, _ = run(model, k, "bfloat16", prompts, args.tokens, invariant=True)
                d = compare(ref_llm, prompts, ref, out)
                print(f"{model:<16} bf16+fp32-matmul num_spec={k}: {len(d)}/{len(prompts)} prompts diverge; "
                      + (", ".join(f"#{i}@{j} (margin {m:.3g})" for i, j, m in d) or "-"))
                ratios = []
                for _ in range(args.rounds):
                    _, _, plain = run(model, k, "bfloat16", prompts, args.tokens)
                    _, _, inv = run(model, k, "bfloat16", prompts, args.tokens, invariant=True)
                    ratios.append(inv / plain)
                print(f"{model:<16} cost of the fp32 matmuls at num_spec={k}: {statistics.median(ratios):.2f}x the "
                      f"bf16 run's time (median of {args.rounds} rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
