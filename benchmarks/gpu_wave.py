"""This wave's features through CUDA graphs on a GPU (issue 33): every check compares a run
with CUDA graphs against the same calls with enforce_eager (token for token; logprobs within a
tolerance), or the feature on against off, on the embedded models in fp32 (tiny-qwen3-next
with its MTP head, tiny-gemma4 with its assistant; num_spec 3) and, for the controls, a random
Qwen3-Next config at real widths:

  controls     each generation control (repetition / presence / frequency penalties, min_p,
               logit_bias, allowed_token_ids, bad words, min_tokens, all at once seeded) as a
               row of one batch beside a plain row: graphs == eager (the captured `controls[n]`
               graph against the eager function; seeded rows sample in the captured sample graph,
               sampling/rejection.sampled_verify, against the eager rejection_sample); the bans
               change the output
  structured   a JSON schema and a regex, greedy and seeded: graphs == eager, the output parses
               (validates) / matches (the drafters mask their own logits; the masked proposal)
  logprobs     logprobs=5, prompt_logprobs=2, greedy and seeded: same tokens, values within tol
  n            n=4 seeded samples (shared prompt blocks, copy-on-write): graphs == eager, and
               sample i == one request of seed + i
  prefix       prefix caching on vs off (chunked prefill, Triton-written state snapshots
               inside the chunks on CUDA): same tokens, the counters show hits; Qwen3-Next's hit
               resumes from a snapshot
  threads      4 threads on one LLM (greedy, seeded, controls, structured) == the serial calls
  memory       the memory plan (CUDA: gpu_memory_utilization leaving --plan-gib GiB, measured by the profile run;
               CPU: memory_budget, estimated): tokens == the default pools'
  assistant    Gemma 4 with its assistant through graphs == greedy without drafts
  sliding      Gemma 4 sliding-window recycling (Triton on CUDA) with a context far past the
               window: same tokens as keeping every block (and, on CUDA, as the torch
               backend); the pool held fewer blocks than the context needs
  real-widths  the controls at real Qwen3-Next widths (vocab 151936), random weights

Each check prints `PASS name (s)` or `FAIL name (s): first difference`, goes on after a failure
or an exception, and is skipped (SKIP) when --budget seconds have passed; exit 0 when all
passed, 1 when any failed, 3 when some were skipped.

    python benchmarks/gpu_wave.py [--checks controls prefix ...] [--max-tokens 24] [--budget SECONDS]
    python benchmarks/gpu_wave.py --device cpu --max-tokens 6 --real-shrink   # this script's logic

--plant-fault NAME compares check NAME's second run against a perturbed copy (its last token
changed): that check must FAIL (the harness's own test, tests/test_gpu_scripts.py).
"""

import argparse
import gc
import itertools
import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline_configs import qwen3_next_config  # noqa: E402

QWEN, GEMMA = "tiny-qwen3-next", "tiny-gemma4"
CHECKS = ["controls", "structured", "logprobs", "n", "prefix", "threads", "memory", "assistant", "sliding",
          "real-widths"]
PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(", "class Stack:\n    def __init__(self):", "for i in range("]
SHARED = ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
          "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "size": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "size"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
LOGPROB_TOL = 2e-3


class Failed(Exception):
    """A check's mismatch: its message is the first difference."""


class Checks:
    def __init__(self, args):
        self.args = args
        self.cuda = args.device == "cuda"
        self.llms = {}
        self.results = []   # (name, "PASS" | "FAIL" | "SKIP", seconds, detail)

    # ---- LLMs -------------------------------------------------------------------------

    def common(self) -> dict:
        # Chunked prefill (48-token chunks) and 32-token snapshot intervals: prompts of ~100
        # tokens are cut into chunks, and the state snapshots land inside them.
        return dict(dtype="float32", device=self.args.device, max_num_seqs=8, max_model_len=512, block_size=16,
                    max_num_batched_tokens=48, prefix_snapshot_interval=32)

    def llm(self, model, *, eager=False, num_spec=3, **kw):
        from mtpkit import LLM
        key = (str(model), eager, num_spec, tuple(sorted(kw.items())))
        if key not in self.llms:
            self.llms[key] = LLM(model, num_spec=num_spec, enforce_eager=eager, **{**self.common(), **kw})
        return self.llms[key]

    def close_all(self):
        for llm in self.llms.values():
            llm.close()
        self.llms.clear()
        gc.collect()
        if self.cuda:
            import torch
            torch.cuda.empty_cache()

    # ---- comparisons ------------------------------------------------------------------

    def planted(self, name, b):
        """--plant-fault: the second run's tokens with the last one changed."""
        if self.args.plant_fault != name or not b or not b[-1]:
            return b
        return [*b[:-1], [*b[-1][:-1], b[-1][-1] + 1]]

    def same(self, name, what, a, b):
        b = self.planted(name, b)
        if a != b:
            raise Failed(f"{what}: {first_difference(a, b)}")

    # ---- running ----------------------------------------------------------------------

    def run(self, names):
        t0 = time.perf_counter()
        for name in names:
            if time.perf_counter() - t0 > self.args.budget:
                self.results.append((name, "SKIP", 0.0, f"out of time ({self.args.budget} s)"))
                print(f"SKIP {name}: out of time ({self.args.budget:.0f} s budget)", flush=True)
                continue
            t = time.perf_counter()
            try:
                detail = getattr(self, "check_" + name.replace("-", "_"))() or ""
                status = "PASS"
            except Failed as e:
                status, detail = "FAIL", str(e)
            except Exception as e:  # noqa: BLE001 - report and go on: one failing check must not hide the others
                traceback.print_exc()
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
            dt = time.perf_counter() - t
            self.results.append((name, status, dt, detail))
            print(f"{status} {name} ({dt:.1f} s){': ' + detail if detail else ''}", flush=True)
        self.close_all()

    # ---- the checks -------------------------------------------------------------------

    def controls_rows(self, llm, prompt):
        """(label, SamplingParams) rows, the bans aimed at the plain greedy tokens so they bite."""
        from mtpkit import SamplingParams
        n = self.args.max_tokens
        plain = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids
        t0, t1, t2 = plain[0], plain[1 % len(plain)], plain[2 % len(plain)]
        vocab = llm.engine.model_config.vocab_size
        sp = lambda **kw: SamplingParams(max_tokens=n, **{"ignore_eos": True, **kw})
        rows = [("plain", sp()),
                ("repetition_penalty", sp(repetition_penalty=1.3)),
                ("presence+frequency", sp(presence_penalty=0.7, frequency_penalty=0.4)),
                ("min_p seeded", sp(temperature=0.9, min_p=0.15, seed=5)),
                ("logit_bias", sp(logit_bias={t0: -100.0, t1: 3.0})),
                ("allowed_token_ids", sp(allowed_token_ids=sorted({t1, t2, *range(min(vocab, 40), min(vocab, 120))}))),
                ("bad_words", sp(bad_words=[[t0], [t1, t2]])),
                ("min_tokens", sp(min_tokens=max(1, n // 2), ignore_eos=False)),
                ("all seeded", sp(temperature=0.8, top_k=40, top_p=0.95, seed=9, repetition_penalty=1.1,
                                  presence_penalty=0.3, frequency_penalty=0.2, min_p=0.05, logit_bias={t1: 2.0}))]
        return plain, rows

    def controls_on(self, eager, graphs, tag, prompt=PROMPTS[0], trained=True):
        plain, rows = self.controls_rows(eager, prompt)
        params = [p for _, p in rows]
        te = [o.token_ids for o in eager.generate([prompt] * len(rows), params)]
        tg = [o.token_ids for o in graphs.generate([prompt] * len(rows), params)]
        tg = self.planted("controls", tg)
        bad = [f"{label}: {first_difference([a], [b])}" for (label, _), a, b in zip(rows, te, tg) if a != b]
        if bad:
            raise Failed(f"{tag} graphs vs eager, " + "; ".join(bad))
        labels = [label for label, _ in rows]
        unbanned = [lb for lb in ("logit_bias", "bad_words") if te[labels.index(lb)][:1] == plain[:1]]
        if unbanned:
            raise Failed(f"{tag}: {unbanned} left the banned first token {plain[0]}")
        # Alone vs in a batch of 9: other GEMM shapes. A trained model's tokens must not change
        # (near ties are rare); random weights have many, so there it is only reported.
        alone = "plain row as alone" + ("" if te[0] == plain else f" differs: {first_difference([plain], [te[0]])}")
        if te[0] != plain and trained:
            raise Failed(f"{tag}: the {alone}")
        return f"{tag}: {len(rows)} rows" + ("" if trained else f" ({alone})")

    def check_controls(self):
        out = []
        for model in (QWEN, GEMMA):
            out.append(self.controls_on(self.llm(model, eager=True), self.llm(model), model))
        return "; ".join(out)

    def check_structured(self):
        from mtpkit import SamplingParams, StructuredOutputs
        try:
            import jsonschema
        except ImportError:
            jsonschema = None
        n = max(self.args.max_tokens, 96)   # room for the whole structure (escapes in the name included)
        specs = [("json", StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)),
                 ("regex", StructuredOutputs(regex=REGEX))]
        params, labels = [], []
        for label, so in specs:
            for seeded in (False, True):
                kw = dict(temperature=0.8, seed=3) if seeded else {}
                params.append(SamplingParams(max_tokens=n, structured_outputs=so, **kw))
                labels.append(f"{label}{' seeded' if seeded else ''}")
        notes = []
        for model in (QWEN, GEMMA):
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
            oe = self.llm(model, eager=True).generate(prompts, params)
            graphs = self.llm(model)
            og = graphs.generate(prompts, params)
            self.same("structured", f"{model} graphs vs eager", [o.token_ids for o in oe], [o.token_ids for o in og])
            for label, o in zip(labels, og):
                if o.finish_reason != "stop":
                    raise Failed(f"{model} {label}: finish_reason {o.finish_reason!r} (text {o.text!r})")
                if label.startswith("json"):
                    value = json.loads(o.text)
                    if jsonschema is not None:
                        jsonschema.validate(value, SCHEMA)
                    elif set(value) != {"name", "size"}:
                        raise Failed(f"{model} {label}: {o.text!r} does not follow the schema")
                elif not re.fullmatch(REGEX, o.text):
                    raise Failed(f"{model} {label}: {o.text!r} does not match {REGEX}")
            notes.append(f"{model}: {og[0].text!r} {og[2].text!r}, acceptance "
                         f"{graphs.stats.mean_acceptance_length:.2f}")
        return "; ".join(notes) + ("" if jsonschema else " (no jsonschema: keys checked)")

    def check_logprobs(self):
        from mtpkit import SamplingParams
        n = self.args.max_tokens
        params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5, prompt_logprobs=2),
                  SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5, temperature=0.8, seed=4,
                                 logprobs_mode="processed")]
        worst = 0.0
        for model in (QWEN, GEMMA):
            oe = self.llm(model, eager=True).generate(PROMPTS[:2], params)
            og = self.llm(model).generate(PROMPTS[:2], params)
            self.same("logprobs", f"{model} tokens", [o.token_ids for o in oe], [o.token_ids for o in og])
            for i, (a, b) in enumerate(zip(oe, og)):
                pairs = list(zip(a.logprobs, b.logprobs)) + list(zip(a.prompt_logprobs or [], b.prompt_logprobs or []))
                for j, (da, db) in enumerate(pairs):
                    if da is None and db is None:
                        continue
                    common = set(da) & set(db)
                    if len(common) < len(da) - 1:   # a near tie may swap the last of the top 5
                        raise Failed(f"{model} prompt {i} position {j}: top tokens {sorted(da)} vs {sorted(db)}")
                    diff = max((abs(da[t].logprob - db[t].logprob) for t in common if da[t].logprob > -1e30), default=0.0)
                    worst = max(worst, diff)
                    if diff > LOGPROB_TOL:
                        raise Failed(f"{model} prompt {i} position {j}: logprobs differ by {diff:.2e} > {LOGPROB_TOL}")
        return f"max |graphs - eager| {worst:.2e} (tol {LOGPROB_TOL})"

    def check_n(self):
        from mtpkit import SamplingParams
        n = self.args.max_tokens
        sp = SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=n, ignore_eos=True)
        for model in (QWEN, GEMMA):
            graphs = self.llm(model)
            te = [c.token_ids for c in self.llm(model, eager=True).generate([PROMPTS[1]], sp)[0].outputs]
            tg = [c.token_ids for c in graphs.generate([PROMPTS[1]], sp)[0].outputs]
            self.same("n", f"{model} n=4 graphs vs eager", te, tg)
            single = [o.token_ids for o in graphs.generate(
                [PROMPTS[1]] * 4, [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=n, ignore_eos=True)
                                   for i in range(4)])]
            self.same("n", f"{model} sample i vs one request of seed 7 + i", single, tg)
            if len({tuple(t) for t in tg}) < 2:
                raise Failed(f"{model}: the 4 samples are all alike: {tg[0]}")
        return "4 samples, both families"

    def check_prefix(self):
        from mtpkit import SamplingParams
        sp = SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True)
        calls = [[SHARED + "        if a[i] <"], [SHARED + "        out.append(", SHARED + "        # take the"]]
        notes = []
        for model in (QWEN, GEMMA):
            on = self.llm(model)
            off = self.llm(model, enable_prefix_caching=False)
            on.reset_prefix_cache()
            before = on.stats.prefix_cache.hit_tokens
            got = {}
            for name, llm in (("off", off), ("on", on)):
                got[name] = [[o.token_ids for o in llm.generate(c, sp)] for c in calls]
            cached = [o.num_cached_tokens for o in on.generate(calls[1], sp)]
            self.same("prefix", f"{model} caching on vs off", flat(got["off"]), flat(got["on"]))
            stats = on.stats.prefix_cache
            if stats.hit_tokens <= before or min(cached) <= 0:
                raise Failed(f"{model}: no hit ({stats}; cached tokens {cached})")
            if model == QWEN and stats.snapshots <= 0:
                raise Failed(f"{model}: a hit without a state snapshot ({stats})")
            notes.append(f"{model}: cached tokens {cached}, {stats}")
        return "; ".join(notes)

    def check_threads(self):
        from mtpkit import SamplingParams, StructuredOutputs
        n = self.args.max_tokens
        calls = [(PROMPTS[:2], SamplingParams(max_tokens=n, ignore_eos=True)),
                 (PROMPTS[1:3], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=21)),
                 (PROMPTS[2:4], SamplingParams(max_tokens=n, ignore_eos=True, repetition_penalty=1.2, min_p=0.1,
                                               temperature=0.7, seed=5)),
                 (PROMPTS[3:4], SamplingParams(max_tokens=max(n, 32),
                                               structured_outputs=StructuredOutputs(regex=REGEX)))]
        for model in (QWEN, GEMMA):
            llm = self.llm(model)
            serial = [[o.token_ids for o in llm.generate(p, sp)] for p, sp in calls]
            got, errors = [None] * len(calls), []
            barrier = threading.Barrier(len(calls))

            def call(i, llm, got, errors, barrier):
                try:
                    barrier.wait()
                    got[i] = [o.token_ids for o in llm.generate(*calls[i])]
                except Exception as e:  # noqa: BLE001 - named in the check's FAIL line
                    errors.append(f"thread {i}: {type(e).__name__}: {e}")

            threads = [threading.Thread(target=call, args=(i, llm, got, errors, barrier)) for i in range(len(calls))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise Failed(f"{model}: " + "; ".join(errors))
            self.same("threads", f"{model} 4 threads vs serial", flat(serial), flat(got))
        return f"{len(calls)} threads, both families"

    def check_memory(self):
        from mtpkit import SamplingParams
        sp = SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True)
        notes = []
        for model in (QWEN, GEMMA):
            ref = [o.token_ids for o in self.llm(model).generate(PROMPTS, sp)]
            if self.cuda:   # a utilization that leaves --plan-gib GiB beyond what this process already holds
                import torch
                free, total = torch.cuda.mem_get_info()
                budget = dict(gpu_memory_utilization=min(1.0, (total - free + (self.args.plan_gib << 30)) / total))
            else:
                budget = dict(memory_budget=64 << 20)
            planned = self.llm(model, **budget)
            plan = planned.memory_plan
            want = "measured" if self.cuda else "estimated"
            if plan is None or plan.activation_source != want:
                raise Failed(f"{model}: plan {plan and plan.summary()} (activations should be {want})")
            got = [o.token_ids for o in planned.generate(PROMPTS, sp)]
            self.same("memory", f"{model} planned pools vs default", ref, got)
            notes.append(f"{model}: {plan.summary()}")
            del self.llms[next(k for k, v in self.llms.items() if v is planned)]
            planned.close()
        return " | ".join(notes)

    def check_assistant(self):
        from mtpkit import SamplingParams
        sp = SamplingParams(max_tokens=max(self.args.max_tokens, 32), ignore_eos=True)
        ref = [o.token_ids for o in self.llm(GEMMA, eager=True, num_spec=0).generate(PROMPTS, sp)]
        graphs = self.llm(GEMMA)
        got = [o.token_ids for o in graphs.generate(PROMPTS, sp)]
        eager = [o.token_ids for o in self.llm(GEMMA, eager=True).generate(PROMPTS, sp)]
        self.same("assistant", "assistant eager vs no drafts", ref, eager)
        self.same("assistant", "assistant through graphs vs no drafts", ref, got)
        rate = graphs.stats.mean_acceptance_length
        if rate <= 1.0:
            raise Failed(f"the assistant's drafts were never accepted (acceptance length {rate:.2f})")
        return f"acceptance length {rate:.2f}"

    def check_sliding(self):
        from mtpkit import SamplingParams
        from mtpkit.engine.kv_pools import blocks_for
        n = self.args.max_tokens
        prompt = SHARED * 2   # ~250 tokens: far past the 64-token window
        sp = SamplingParams(max_tokens=n, ignore_eos=True)
        runs = {}
        for label, kw in (("recycled", {}), ("kept", dict(recycle_sliding_kv=False)),
                          *((("torch backend", dict(attn_backend="torch")),) if self.cuda else ())):
            llm = self.llm(GEMMA, enable_prefix_caching=False, **kw)
            pool = next(p for p in llm.kv_pools.capacity if p.startswith("sliding"))
            cap, used, toks = llm.kv_pools.capacity[pool], 0, []
            for ev in llm.stream([prompt], sp):
                toks.extend(ev.new_token_ids)
                used = max(used, cap - llm.kv_pools.num_free[pool])
            runs[label] = (toks, used, pool)
        toks, used, pool = runs["recycled"]
        for label, (other, _, _) in runs.items():
            self.same("sliding", f"recycled (Triton on CUDA) vs {label}", [other], [toks])
        ctx = len(self.llm(GEMMA).tokenizer.encode(prompt).ids) + n
        need = blocks_for(ctx, 16)
        if used >= need or runs["kept"][1] < need - 1:
            raise Failed(f"{pool}: {used} blocks held at most with recycling, {runs['kept'][1]} without, "
                         f"for a context of {ctx} tokens ({need} blocks)")
        return f"context {ctx} tokens: {pool} held at most {used} blocks recycled, {runs['kept'][1]} kept"

    def check_real_widths(self):
        cfg = qwen3_next_config(self.args.real_layers, self.args.real_experts)
        if self.args.real_shrink:   # CPU runs of this logic: the same config, narrow
            cfg.update(vocab_size=512, hidden_size=64, num_attention_heads=2, head_dim=16, intermediate_size=64,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       num_experts_per_tok=2, eos_token_id=None)
        path = Path(tempfile.mkdtemp()) / "qwen3-next-real-widths"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        self.close_all()   # the embedded models' LLMs are done with
        kw = dict(load_format="dummy", seed=0)
        out = self.controls_on(self.llm(path, eager=True, **kw), self.llm(path, **kw),
                               f"{cfg['vocab_size']} vocab, {cfg['num_experts']} experts",
                               prompt=[(17 * j + 5) % cfg["vocab_size"] for j in range(12)],   # no tokenizer
                               trained=False)
        self.close_all()
        return out


def flat(calls):
    """One list of outputs from a list of calls' outputs."""
    return list(itertools.chain.from_iterable(calls))


def first_difference(a, b) -> str:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} outputs"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((p for p, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return f"output {i}, token {j}: {x[max(0, j - 2):j + 2]} vs {y[max(0, j - 2):j + 2]}"
    return "none"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script's own logic")
    ap.add_argument("--checks", nargs="+", default=CHECKS, choices=CHECKS)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget", type=float, default=max(20.0, float(os.environ.get("PART_CAP", "160")) - 20),
                    help="seconds after which the checks left are skipped (SKIP); default: gpu_all.sh's cap "
                         "for this part (PART_CAP) less 20 s, else 140")
    ap.add_argument("--plan-gib", type=int, default=1, help="memory: the budget gpu_memory_utilization leaves (GiB)")
    ap.add_argument("--real-layers", type=int, default=4)
    ap.add_argument("--real-experts", type=int, default=64)
    ap.add_argument("--real-shrink", action="store_true", help="real-widths at tiny widths (CPU runs)")
    ap.add_argument("--plant-fault", choices=CHECKS, default=None)
    args = ap.parse_args(argv)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_wave: CUDA is not available; this check needs a GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"== gpu_wave: device {name}, torch {torch.__version__}, checks {' '.join(args.checks)} ==", flush=True)
    checks = Checks(args)
    checks.run(args.checks)
    counts = {s: sum(r[1] == s for r in checks.results) for s in ("PASS", "FAIL", "SKIP")}
    print("gpu_wave: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f" in {sum(r[2] for r in checks.results):.0f} s"
          + ("" if not counts["FAIL"] else " - FAILED: " + " ".join(r[0] for r in checks.results if r[1] == "FAIL")),
          flush=True)
    return 1 if counts["FAIL"] else 3 if counts["SKIP"] else 0


if __name__ == "__main__":
    sys.exit(main())
