"""One timed run for compare_trees.sh: 8 prompts x 64 greedy tokens, batch 1, one thread, CPU
traces from the first step, after a warm-up; prints the seconds of the timed generations."""
import sys, time, torch
from mtpkit import LLM, SamplingParams
model, k = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
llm = LLM(model, num_spec=k)
llm.runner.graphs.trace_after = 0
prompts = [[(7 * i + j) % 200 + 10 for j in range(32)] for i in range(8)]
p = SamplingParams(max_tokens=64, ignore_eos=True)
for pr in prompts[:2]: llm.generate(pr, p)
t0 = time.perf_counter()
for pr in prompts: llm.generate(pr, p)
print(time.perf_counter() - t0)
