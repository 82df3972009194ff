"""CPU benchmark, one process, same prompts: transformers 5.24 greedy generate vs mtpkit
without MTP vs mtpkit with num_spec 1..4, at batch 1 and 8.

Prints tokens/s and the ratios to transformers and to mtpkit without MTP, and checks that every
greedy output is identical (prompts in a batch have the same length, so transformers needs no
padding). Each configuration is timed `--repeats` times after a warm-up; the best run counts
(the machine is shared and noisy: the best run is the least disturbed one). The mtpkit engines
are long-lived: their CPU decode graphs are traced on first use (`trace_after = 0`), so the
warm-up pays for tracing and the timed runs measure the steady state.

    python benchmarks/bench_cpu.py                      # the embedded model
    python benchmarks/bench_cpu.py --max-tokens 64 --batches 1 8 --threads 2
"""

import argparse
import time

import torch

from mtpkit import LLM, SamplingParams
from mtpkit.models.registry import resolve_model

def heldout_prompts(batch: int, length: int) -> list[list[int]]:
    """`length` tokens from each of the first `batch` usable held-out stdlib files (the files the
    embedded model never trained on), starting at the first line break past a third of the file."""
    from mtpkit.train import encode_bytes, heldout_documents

    prompts = []
    for _, data in heldout_documents():
        start = data.find(b"\n", len(data) // 3) + 1
        ids = encode_bytes(data[start:start + length])
        if start > 0 and len(ids) == length:
            prompts.append(ids)
        if len(prompts) == batch:
            return prompts
    raise SystemExit(f"only {len(prompts)} held-out files are long enough for {length}-token prompts")


def hf_generate(model, prompts, max_tokens):
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return [row[len(p):].tolist() for row, p in zip(out, prompts)]


def best_time(fn, repeats):
    fn()  # warm-up
    best, result = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-spec", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3NextForCausalLM

    path = resolve_model(args.model)
    hf = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engines = {k: LLM(path, num_spec=k, dtype="float32", max_num_seqs=max(args.batches))
               for k in range(args.max_spec + 1)}
    for llm in engines.values():  # long-lived engines: CPU graphs traced on first use (graphs.runner)
        llm.runner.graphs.trace_after = 0
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    print(f"model={path.name} max_tokens={args.max_tokens} prompt_len={args.prompt_len} "
          f"threads={torch.get_num_threads()} (best of {args.repeats})")
    all_same = True
    for batch in args.batches:
        prompts = heldout_prompts(batch, args.prompt_len)
        n = batch * args.max_tokens
        t_hf, ref = best_time(lambda: hf_generate(hf, prompts, args.max_tokens), args.repeats)
        rows = [("transformers", n / t_hf, ref, None)]
        for k, llm in engines.items():
            def run():
                llm.stats.__init__(num_spec=k)
                return [o.token_ids for o in llm.generate(prompts, sp)]
            t, toks = best_time(run, args.repeats)
            rows.append((f"mtpkit num_spec={k}", n / t, toks, llm.stats.mean_acceptance_length if k else None))
        base = rows[1][1]
        print(f"\nbatch {batch}:")
        print(f"  {'engine':<20} {'tok/s':>8} {'x transformers':>14} {'x mtpkit k=0':>12} {'mean acc len':>12} {'same tokens':>11}")
        for name, tps, toks, mal in rows:
            same = toks == ref
            all_same &= same
            print(f"  {name:<20} {tps:>8.1f} {tps / rows[0][1]:>14.2f} {tps / base:>12.2f} "
                  f"{'' if mal is None else f'{mal:.2f}':>12} {str(same):>11}")
    print(f"\nall greedy outputs identical: {all_same}")


if __name__ == "__main__":
    main()
