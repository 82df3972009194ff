"""Per-step cost of the generation controls (mtpkit/sampling/controls.py) at batch 8: the mean
verify step (model, controls, rejection, drafter) with no control vs every control on every
row (repetition / presence / frequency penalties, min_p, logit_bias, allowed_token_ids,
bad_words, min_tokens), on one engine, in rotating rounds (the machine is noisy); each ratio
is the median over rounds of the two configurations' same-round ratio. Also the time inside
the controls themselves per step (ModelRunner._controls: the host side, and the captured
part's replay).

Two implementations of "all controls" run in the same rounds: "after", the current one (the
graph-safe part replayed as the controls graph on the static buffers: a CPU trace after
CPU_TRACE_AFTER steps, like the verify graph; the multi-token bad words eager), and "before",
the eager per-request implementation it replaced (benchmarks/controls_before.py, mtpkit at
3ee0ad5), patched into the runner.

    python benchmarks/controls_cost.py
    python benchmarks/controls_cost.py --model tiny-gemma4 --rounds 7 --max-tokens 64

Every configuration samples (temperature 0.8, seeded), so min_p applies; their tokens differ
between none and all on, so the steps are counted, not the tokens (before and after give the
same tokens: checked once).
"""

import argparse
import statistics
import time

import controls_before
import torch

from mtpkit import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):",
           "x = [", "def parse_args(argv):\n    ", "with open(path) as f:", "return sorted("]
CONFIGS = ("none", "before", "after")


def params(all_on: bool, max_tokens: int, vocab: int) -> list[SamplingParams]:
    base = dict(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
    if not all_on:
        return [SamplingParams(seed=i, **base) for i in range(len(PROMPTS))]
    return [SamplingParams(seed=i, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05,
                           logit_bias={10: 1.0, 32: -1.0}, allowed_token_ids=list(range(vocab - 1)),
                           bad_words=[[101, 102], [7]], min_tokens=4, **base)
            for i in range(len(PROMPTS))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3-next")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, num_spec=a.num_spec, max_num_seqs=8, dtype="float32")
    vocab = llm.model_config.vocab_size
    runner = llm.runner
    timing = {"verify": [0.0, 0], "controls": [0.0, 0]}
    verify, current = runner._verify, runner._controls

    def before(logits, drafts, reqs, captured):
        return controls_before.controlled_logits(logits, drafts, reqs)

    def timed(key, fn):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            timing[key][0] += time.perf_counter() - t
            timing[key][1] += 1
            return out
        return wrapper
    runner._verify = timed("verify", verify)

    def run(config: str) -> tuple[float, float, list]:
        for v in timing.values():
            v[0], v[1] = 0.0, 0
        runner._controls = timed("controls", before if config == "before" else current)
        outs = llm.generate(PROMPTS, params(config != "none", a.max_tokens, vocab))
        return (timing["verify"][0] / timing["verify"][1], timing["controls"][0] / timing["controls"][1],
                [o.token_ids for o in outs])

    for _ in range(2):   # warm-up: the CPU traces of the verify / propose / controls bodies (every context bucket)
        warm = {c: run(c) for c in CONFIGS}
    assert warm["before"][2] == warm["after"][2], "before and after gave different tokens"
    per = {c: [] for c in CONFIGS}
    ratios = {"before": [], "after": [], "after/before": [], "controls after/before": []}
    for r in range(a.rounds):
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        got = {c: run(c)[:2] for c in order}
        for c in CONFIGS:
            per[c].append(got[c])
        ratios["before"].append(got["before"][0] / got["none"][0])
        ratios["after"].append(got["after"][0] / got["none"][0])
        ratios["after/before"].append(got["after"][0] / got["before"][0])
        ratios["controls after/before"].append(got["after"][1] / got["before"][1])
    names = {"none": "no control         ", "before": "all controls before", "after": "all controls after "}
    for c in CONFIGS:
        step = statistics.median(s for s, _ in per[c]) * 1e3
        ctl = statistics.median(x for _, x in per[c]) * 1e3
        print(f"{names[c]}: verify step {step:7.3f} ms, in the controls {ctl:6.3f} ms  (batch 8, num_spec "
              f"{a.num_spec}, {a.model})")
    for key, label in (("before", "all controls (before) / none"), ("after", "all controls (after) / none"),
                       ("after/before", "after / before (all controls)"),
                       ("controls after/before", "time in the controls, after / before")):
        xs = ratios[key]
        print(f"{'' if key.startswith('controls') else 'verify step, '}{label}: {statistics.median(xs):.3f} (median of {a.rounds} same-round ratios; per "
              f"round {', '.join(f'{x:.3f}' for x in xs)})")


if __name__ == "__main__":
    main()
