"""Per-step cost of the generation controls (mtpkit/sampling/controls.py) at batch 8: the mean
verify step (model, controls, rejection, drafter) with no control vs every control on every
row (repetition / presence / frequency penalties, min_p, logit_bias, allowed_token_ids,
bad_words, min_tokens), on one engine, in alternating rounds (the machine is noisy); the
ratio is the median over rounds of the two configurations' same-round ratio. Also the time
inside controlled_logits itself, per step.

    python benchmarks/controls_cost.py
    python benchmarks/controls_cost.py --model tiny-gemma4 --rounds 7 --max-tokens 64

Both configurations sample (temperature 0.8, seeded), so min_p applies; their tokens differ,
so the steps are counted, not the tokens.
"""

import argparse
import statistics
import time

import torch

import mtpkit.engine.runner as runner_module
from mtpkit import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):",
           "x = [", "def parse_args(argv):\n    ", "with open(path) as f:", "return sorted("]


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
    timing = {"verify": [0.0, 0], "controls": [0.0, 0]}
    verify, controlled = llm.runner._verify, runner_module.controlled_logits

    def timed(key, fn):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            timing[key][0] += time.perf_counter() - t
            timing[key][1] += 1
            return out
        return wrapper
    llm.runner._verify = timed("verify", verify)
    runner_module.controlled_logits = timed("controls", controlled)

    def run(all_on: bool) -> tuple[float, float]:
        for v in timing.values():
            v[0], v[1] = 0.0, 0
        llm.generate(PROMPTS, params(all_on, a.max_tokens, vocab))
        return timing["verify"][0] / timing["verify"][1], timing["controls"][0] / timing["controls"][1]

    run(False), run(True)    # warm-up: the CPU traces of the verify / propose bodies
    per = {False: [], True: []}
    ratios = []
    for r in range(a.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {on: run(on) for on in order}
        for on in (False, True):
            per[on].append(got[on])
        ratios.append(got[True][0] / got[False][0])
    for on in (False, True):
        step = statistics.median(s for s, _ in per[on]) * 1e3
        ctl = statistics.median(c for _, c in per[on]) * 1e3
        print(f"{'all controls' if on else 'no control  '}: verify step {step:7.3f} ms, in controlled_logits "
              f"{ctl:6.3f} ms  (batch 8, num_spec {a.num_spec}, {a.model})")
    print(f"verify step, all controls / none: {statistics.median(ratios):.3f} "
          f"(median of {a.rounds} same-round ratios; per round {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
