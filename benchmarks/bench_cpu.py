"""CPU benchmark, one process, same prompts: transformers 5.24 greedy generate vs mtpkit
without drafts vs mtpkit with num_spec 1..k, at batch 1 and 8. For Qwen3-Next (the embedded
tiny-qwen3-next) the drafter is its MTP head; for Gemma 4 (`--model tiny-gemma4`) it is the
target's assistant (its default drafter), and transformers also runs assisted generation with
the same assistant (`assistant_model=`, batch 1 only: transformers does not batch it) for
every num_assistant_tokens 1..k.

Prints tokens/s and the ratios to transformers and to mtpkit without MTP, and checks that every
greedy output is identical (prompts in a batch have the same length, so transformers needs no
padding). After a warm-up, `--rounds` rounds each run every configuration once (round-robin:
a noisy stretch of the shared machine hits every configuration alike). tok/s comes from each
configuration's median time; a ratio is the median over rounds of the two configurations'
same-round ratio. The mtpkit engines
are long-lived: their CPU decode graphs are traced on first use (`trace_after = 0`), so the
warm-up pays for tracing and the timed runs measure the steady state. Their prefix cache is
off (`enable_prefix_caching=False`) unless `--prefix-caching`: the rounds repeat the warm-up's
prompts, which a cache would serve from its blocks while llama.cpp's driver (which clears its
memory per prompt) and transformers prefill every prompt in full.

    python benchmarks/bench_cpu.py                      # the embedded model
    python benchmarks/bench_cpu.py --max-tokens 128 --batches 1 8 --threads 1 --rounds 7
    python benchmarks/bench_cpu.py --model tiny-gemma4 --max-spec 6 --max-tokens 128 --threads 1 --rounds 5

Every batch size runs the same `--prompts` held-out prompts (8), `batch` at a time: at batch 1
that is 8 generations one after another.

llama.cpp, what people run on CPUs instead, is the baseline when it is built
(`python benchmarks/llamacpp/build.py`; `--llamacpp DIR` or $MTPKIT_LLAMACPP for another
workdir than ~/.cache/mtpkit-llamacpp): at batch 1, rows for llama.cpp plain and MTP
(draft-mtp with the MTP head, or the Gemma 4 assistant as its drafter; `--llamacpp-drafts`,
default 3; f32 GGUFs),
each a long-lived driver process fed token ids (benchmarks/llamacpp/driver.cpp), alternated
in the rounds like every other engine, and ratios x llama.cpp. Without it the table says how
to build it and goes on without those rows.

`--compile MODE` (inductor, freeze or aot: LLM(compile=...), mtpkit/graphs/compiled.py) adds an
engine per num_spec whose decode graphs are compiled (in the warm-up, `compile_after = 0`), rows
"mtpkit num_spec=k MODE", alternated with the traced ones in the same rounds, and their ratio
x the traced engine of the same num_spec. `--draft-dtype bfloat16` adds, beside each of them, the
same compiled engine with its drafter in bfloat16 (LLM(draft_dtype=...)), rows "... draft bfloat16"
(num_spec 0 has no drafter: none), alternated like the others; outputs must stay identical.
`--scheduler-steps N` adds mtpkit without drafts running up to N decode steps per scheduling
(LLM(num_scheduler_steps=N)): a row "mtpkit num_spec=0 N steps" (traced), and with --compile one
"mtpkit num_spec=0 MODE N steps", alternated like the others.
"""

import argparse
import statistics
import time

import sys
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # training/ is not installed

from mtpkit import LLM, SamplingParams
from mtpkit.engine.args import COMPILE_MODES
from mtpkit.checkpoint.hub import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent / "llamacpp"))
import llamacpp_client  # noqa: E402  (benchmarks/llamacpp)

def heldout_prompts(batch: int, length: int) -> list[list[int]]:
    """`length` tokens from each of the first `batch` usable held-out stdlib files (the files the
    embedded models never trained on), starting at the first line break past a third of the file."""
    from training.corpus import encode_bytes, heldout_documents

    prompts = []
    for _, data in heldout_documents():
        start = data.find(b"\n", len(data) // 3) + 1
        ids = encode_bytes(data[start:start + length])
        if start > 0 and len(ids) == length:
            prompts.append(ids)
        if len(prompts) == batch:
            return prompts
    raise SystemExit(f"only {len(prompts)} held-out files are long enough for {length}-token prompts")


def hf_generate(model, prompts, max_tokens, assistant=None, num_assistant_tokens=None):
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    kw = {}
    if assistant is not None:   # a fixed draft length (transformers' default schedule adapts it)
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = num_assistant_tokens, "constant"
        assistant.generation_config.num_assistant_tokens = num_assistant_tokens
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kw["assistant_model"] = assistant
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kw)
    return [row[len(p):].tolist() for row, p in zip(out, prompts)]


def hf_models(path):
    """The transformers target and (Gemma 4) its assistant, float32, eval mode."""
    import json

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type == "qwen3_next":
        from transformers import Qwen3NextForCausalLM
        return Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), None
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from mtpkit.checkpoint.hub import checkpoint_default_drafter
    target = Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(resolve_model(checkpoint_default_drafter(path)),
                                                           dtype=torch.float32).eval()
    return target, assistant


def round_robin(fns: dict, rounds: int) -> tuple[dict, dict]:
    """Wall times of every function in every round, and each one's last result. Each round
    runs every function once, so a noisy stretch of the machine (another process, the clock
    moving with the other core's load) hits them alike instead of one configuration's
    consecutive repeats."""
    results = {name: fn() for name, fn in fns.items()}  # warm-up
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t)
    return times, results


def ratio(times: dict, a, b) -> float:
    """Median over rounds of how much faster a ran than b in the same round."""
    return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompts", type=int, default=8,
                   help="held-out prompts per run: batch b generates them b at a time (batch 1: one by one)")
    p.add_argument("--max-spec", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--llamacpp", type=Path, default=None,
                   help="llama.cpp workdir of benchmarks/llamacpp/build.py (default $MTPKIT_LLAMACPP "
                        "or ~/.cache/mtpkit-llamacpp)")
    p.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="also run mtpkit engines with compiled decode graphs (LLM(compile=...))")
    p.add_argument("--compile-spec", type=int, nargs="+", default=None,
                   help="the num_spec values of the compiled engines (default: 0..--max-spec)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="keep mtpkit's prefix cache on: the timed rounds then reuse the warm-up's prompt "
                        "blocks, which the other engines prefill again (not a like-for-like comparison)")
    p.add_argument("--draft-dtype", default=None, help="also run each compiled engine with num_spec > 0 with "
                   "its drafter in this dtype (LLM(draft_dtype=...); needs --compile)")
    p.add_argument("--scheduler-steps", type=int, default=None,
                   help="also run mtpkit without drafts at LLM(num_scheduler_steps=N), traced (and compiled)")
    p.add_argument("--llamacpp-drafts", type=int, default=llamacpp_client.NUM_DRAFTS,
                   help="llama.cpp's draft length in MTP mode")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    hf, hf_assistant = hf_models(path)
    common = dict(dtype="float32", max_num_seqs=max(args.batches), enable_prefix_caching=args.prefix_caching)
    engines = {k: LLM(path, num_spec=k, **common) for k in range(args.max_spec + 1)}
    if args.compile:   # keys ("c", k): compiled in the warm-up, so the rounds time the steady state
        engines.update({("c", k): LLM(path, num_spec=k, compile=args.compile, compile_after=0, **common)
                        for k in (args.compile_spec or range(args.max_spec + 1))})
    if args.draft_dtype:   # keys ("d", k): the compiled engine of num_spec k, its drafter in draft_dtype
        if not args.compile:
            p.error("--draft-dtype adds compiled engines: give --compile too")
        engines.update({("d", k): LLM(path, num_spec=k, compile=args.compile, compile_after=0,
                                      draft_dtype=args.draft_dtype, **common)
                        for k in (args.compile_spec or range(args.max_spec + 1)) if k})
    if args.scheduler_steps:   # keys ("s", 0) traced, ("cs", 0) compiled: num_spec 0, decode runs
        engines["s", 0] = LLM(path, num_scheduler_steps=args.scheduler_steps, **common)
        if args.compile:
            engines["cs", 0] = LLM(path, compile=args.compile, compile_after=0,
                                   num_scheduler_steps=args.scheduler_steps, **common)
    for llm in engines.values():  # long-lived engines: CPU graphs traced on first use (graphs.captured)
        llm.runner.graphs.trace_after = 0
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llamacpp = llamacpp_drivers(args.llamacpp or llamacpp_client.workdir_from_env(), path.name,
                                args.threads or torch.get_num_threads(), args.llamacpp_drafts)
    print(f"model={path.name} prompts={args.prompts} max_tokens={args.max_tokens} prompt_len={args.prompt_len} "
          f"mtpkit prefix cache {'on' if args.prefix_caching else 'off'} "
          f"threads={torch.get_num_threads()}; {args.rounds} rounds, each running every engine once: "
          f"tok/s from the median time, ratios the median of same-round ratios")
    all_same = True
    prompts = heldout_prompts(max(args.prompts, *args.batches), args.prompt_len)
    for batch in args.batches:
        # The same prompts at every batch size, `batch` at a time: one prompt's acceptance says
        # little (it varies from ~3.3 to ~3.9 per prompt at num_spec 3).
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        n = len(prompts) * args.max_tokens
        fns = {"transformers": lambda: [t for g in groups for t in hf_generate(hf, g, args.max_tokens)]}
        if hf_assistant is not None and batch == 1:
            for k in range(1, args.max_spec + 1):
                fns[f"hf{k}"] = lambda k=k: [t for g in groups
                                             for t in hf_generate(hf, g, args.max_tokens, hf_assistant, k)]
        for k, llm in engines.items():
            def run(k=k, llm=llm):
                llm.stats.__init__(num_spec=k[1] if isinstance(k, tuple) else k)
                return [o.token_ids for g in groups for o in llm.generate(g, sp)]
            fns[k] = run
        if batch == 1:   # the driver decodes one sequence at a time
            for name, d in llamacpp.items():
                fns[name] = lambda d=d: [d.generate(p, args.max_tokens) for p in prompts]
        times, results = round_robin(fns, args.rounds)
        stats = {name: results[name] for name in llamacpp if name in results}
        for name in stats:
            results[name] = [g.tokens for g in stats[name]]
        ref = results["transformers"]
        print(f"\nbatch {batch}:")
        lc = "llama.cpp" if "llama.cpp" in fns else None
        lb = min(stats, key=lambda k: statistics.median(times[k])) if stats else None   # llama.cpp's best mode
        print(f"  {'engine':<42} {'tok/s':>8} {'x transformers':>14} {'x mtpkit k=0':>12} "
              f"{'x llama.cpp' if lc else '':>11} {'mean acc len':>12} {'same tokens':>11}")
        for name in fns:
            same = results[name] == ref
            all_same &= same
            if name in llamacpp:
                label = f"{name} {args.llamacpp_drafts} drafts" if name != "llama.cpp" else "llama.cpp f32"
            elif isinstance(name, str):
                label = name if name == "transformers" else f"transformers assisted k={name[2:]}"
            elif isinstance(name, tuple) and name[0] in ("s", "cs"):
                label = f"mtpkit num_spec=0{' ' + args.compile if name[0] == 'cs' else ''} " \
                        f"{args.scheduler_steps} steps"
            elif isinstance(name, tuple):
                label = f"mtpkit num_spec={name[1]} {args.compile}" + (f" draft {args.draft_dtype}"
                                                                       if name[0] == "d" else "")
            else:
                label = f"mtpkit num_spec={name}"
            k = name[1] if isinstance(name, tuple) else name
            mal = engines[name].stats.mean_acceptance_length if name in engines and k else None
            if name in stats and name != "llama.cpp":
                mal = sum(len(g.tokens) for g in stats[name]) / sum(g.n_steps for g in stats[name])
            x_lc = f"{ratio(times, name, lc):.2f}" if lc else ""
            print(f"  {label:<42} {n / statistics.median(times[name]):>8.1f} {ratio(times, name, 'transformers'):>14.2f} "
                  f"{ratio(times, name, 0):>12.2f} {x_lc:>11} {'' if mal is None else f'{mal:.2f}':>12} {str(same):>11}")
        hf_best = [k for k in fns if isinstance(k, str) and k.startswith("hf")]
        ours = [k for k in fns if isinstance(k, int) and k]
        if ours:
            best = min(ours, key=lambda k: statistics.median(times[k]))
            line = (f"  best mtpkit num_spec={best}: {ratio(times, best, 0):.2f}x mtpkit without drafts, "
                    f"{ratio(times, best, 'transformers'):.2f}x transformers")
            if hf_best:
                hb = min(hf_best, key=lambda k: statistics.median(times[k]))
                line += f", {ratio(times, best, hb):.2f}x transformers' best assisted (k={hb[2:]})"
            if lc:
                line += (f", {ratio(times, best, lb):.2f}x llama.cpp's best ({lb}); mtpkit without "
                         f"drafts {ratio(times, 0, lb):.2f}x")
            print(line)
        runs = [k for k in fns if isinstance(k, tuple) and k[0] in ("s", "cs")]
        if runs:
            line = f"  {args.scheduler_steps} decode steps per scheduling x one: " + ", ".join(
                f"{'traced' if c == 's' else args.compile} {ratio(times, (c, 0), 0 if c == 's' else ('c', 0)):.2f}"
                for c, _ in runs if c == "s" or ("c", 0) in times)
            if lc:
                line += "; x llama.cpp's best: " + ", ".join(
                    f"{'traced' if c == 's' else args.compile} {ratio(times, (c, 0), lb):.2f}"
                    for c, _ in runs)
            print(line)
        compiled = [k for k in fns if isinstance(k, tuple) and k[0] in ("c", "d")]
        if compiled and ours:
            same = [k for c, k in compiled if c == "c" and k in times]   # a compiled num_spec above --max-spec has no traced twin
            if same:
                print(f"  {args.compile} x traced, same num_spec: " + ", ".join(
                    f"k={k}: {ratio(times, ('c', k), k):.2f}" for k in same))
            if any(c == "d" for c, _ in compiled):
                print(f"  draft {args.draft_dtype} x the same compiled engine: " + ", ".join(
                    f"k={k}: {ratio(times, ('d', k), ('c', k)):.3f}" for c, k in compiled if c == "d"))
            best_c = min(compiled, key=lambda k: statistics.median(times[k]))
            drafts = f" draft {args.draft_dtype}" if best_c[0] == "d" else ""
            line = (f"  best compiled num_spec={best_c[1]}{drafts}: {ratio(times, best_c, best):.2f}x the best traced, "
                    f"{ratio(times, best_c, 0):.2f}x traced without drafts")
            if lc:
                line += f", {ratio(times, best_c, lb):.2f}x llama.cpp's best"
                if ("c", 0) in times:
                    line += f"; compiled without drafts {ratio(times, ('c', 0), lb):.2f}x"
            print(line)
    if args.compile:
        for k in args.compile_spec or range(args.max_spec + 1):
            print(f"num_spec={k} {args.compile}: {engines['c', k].runner.graphs.compiler.describe()}")
            if ("d", k) in engines:
                print(f"num_spec={k} {args.compile} draft {args.draft_dtype}: "
                      f"{engines['d', k].runner.graphs.compiler.describe()}")
    print(f"\nall greedy outputs identical: {all_same}")
    for d in llamacpp.values():
        d.close()


def llamacpp_drivers(workdir: Path, model: str, threads: int, num_drafts: int) -> dict:
    """llama.cpp plain and MTP drivers for `model`, or none (saying how to build them)."""
    why = llamacpp_client.missing(workdir, model)
    if why:
        print(f"no llama.cpp baseline: {why}")
        return {}
    files = llamacpp_client.model_files(workdir, model)
    driver = llamacpp_client.driver_path(workdir)
    return {"llama.cpp": llamacpp_client.LlamaCppDriver(driver, *files, mode="plain", threads=threads),
            "llama.cpp mtp": llamacpp_client.LlamaCppDriver(driver, *files, mode="mtp", threads=threads,
                                                            num_drafts=num_drafts)}


if __name__ == "__main__":
    main()
