"""CPU time (not wall time: the machine is shared) of greedy generation on the embedded model,
8 held-out prompts one at a time, 128 new tokens, num_spec 0 and 3, graphs traced at once."""
import sys, time, torch
sys.path.insert(0, "benchmarks")
from bench_cpu import heldout_prompts
from mtpkit import LLM, SamplingParams
torch.set_num_threads(1)
prompts = heldout_prompts(8, 64)
sp = SamplingParams(max_tokens=128, ignore_eos=True)
out = {}
for k in (0, 3):
    llm = LLM("tiny-qwen3-next", num_spec=k, num_threads=1)
    if llm.runner.graphs is not None:
        llm.runner.graphs.trace_after = 0
    for p in prompts[:2]:
        llm.generate([p], sp, use_tqdm=False) if "use_tqdm" in LLM.generate.__code__.co_varnames else llm.generate([p], sp)
    best = None
    for _ in range(3):
        t0 = time.process_time()
        for p in prompts:
            llm.generate([p], sp)
        t = time.process_time() - t0
        best = t if best is None else min(best, t)
    out[k] = best
print(f"cpu s: k=0 {out[0]:.3f}  k=3 {out[3]:.3f}  ratio {out[0]/out[3]:.3f}")
