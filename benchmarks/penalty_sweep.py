"""Which default penalty makes an embedded model's greedy output read like code, and what it
costs in acceptance: six prompts (the main job's first), 128 tokens each, batch 6, num_spec 3,
float32; for each setting the mean acceptance length over the batch and the first two outputs.
The measurements behind the embedded models' generation_config.json (their READMEs).

    python benchmarks/penalty_sweep.py                       # tiny-qwen3-next
    python benchmarks/penalty_sweep.py --model tiny-gemma4
"""

import argparse

from mtpkit import LLM, SamplingParams
from mtpkit.engine.request import SpecStats

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def parse_args(argv):\n    ",
           "with open(path) as f:", "for i in range(10):"]
SETTINGS = [{}, {"repetition_penalty": 1.1}, {"repetition_penalty": 1.2}, {"repetition_penalty": 1.3},
            {"repetition_penalty": 1.5}, {"frequency_penalty": 0.1}, {"frequency_penalty": 0.2},
            {"presence_penalty": 0.5}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3-next")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    llm = LLM(a.model, num_spec=3, max_num_seqs=8, dtype="float32")
    for kw in SETTINGS:
        llm.stats = SpecStats()
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=a.max_tokens, **kw))
        print(f"=== {kw or 'no penalty'}: mean acceptance length {llm.stats.mean_acceptance_length:.2f}")
        for o in outs[:2]:
            print(f"    {o.text!r}")


if __name__ == "__main__":
    main()
