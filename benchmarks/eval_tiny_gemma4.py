"""Quality of tiny-gemma4 and its assistant on the held-out split (training/corpus.py), with
the training models (training/gemma4_target.py, training/gemma4_assistant.py; both checked
against transformers 5.24 in tests/test_train_gemma4.py), float32, one thread.

1. Teacher-forced, fixed windows of the held-out stream: the target's next-token loss (bits
   per byte) and accuracy; how often draft step k's argmax equals the target's greedy token
   (the assistant fed the window's tokens).
2. Speculation, simulated (training/gemma4_spec_sim.py): held-out prompts, num_spec 1..6,
   greedy and at temperature 0.7: mean acceptance length and acceptance per draft position
   (at 0.7: expected values, drafts one-hot). Every greedy run must reproduce num_spec 0.
3. `--hf-check`: transformers' own `generate(assistant_model=...)` (batch 1) against its plain
   greedy output, and mtpkit's greedy output against transformers' (tie-aware).
4. `--compare DIR`: another assistant of the same target (e.g. with ordered embeddings)
   through 1-2, and the eager time of one draft step of each.

    python benchmarks/eval_tiny_gemma4.py --hf-check --json results.json
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # training/ is not installed

from training import gemma4_assistant as A  # noqa: E402
from training.corpus import heldout_prompts, spaced_heldout_windows  # noqa: E402
from training.gemma4_assistant_io import load_assistant  # noqa: E402
from training.gemma4_spec_sim import forward, speculate  # noqa: E402
from training.gemma4_target import evaluate as target_evaluate  # noqa: E402
from training.gemma4_train import load_target  # noqa: E402

ASSETS = ROOT / "mtpkit" / "assets"


def teacher_forced(tgt, assistants: dict, windows: torch.Tensor, depth: int) -> dict:
    T = windows.shape[1] - depth
    ev = target_evaluate(tgt, windows[:, :T + 1], 8)
    out = {"tokens": ev["tokens"], "ntp_bits_per_byte": ev["ntp"] / math.log(2), "ntp_accuracy": ev["ntp_acc"]}
    for name, asst in assistants.items():
        out[name] = A.evaluate(asst, tgt, windows, T, depth, 8)
    return out


def speculation(tgt, asst, prompts, new_tokens: int, num_specs: list[int], temperature: float, seed: int) -> dict:
    ref, _ = speculate(tgt, None, prompts, new_tokens, 0, temperature, seed)
    out = {}
    for k in num_specs:
        t = time.time()
        tokens, st = speculate(tgt, asst, prompts, new_tokens, k, temperature, seed)
        row = {"mean_acceptance_length": st.mean_acceptance_length,
               "acceptance_rate_per_position": st.acceptance_rate_per_position, "rounds": st.rounds}
        if temperature == 0:
            row["same_tokens_as_num_spec_0"] = f"{sum(a == b for a, b in zip(tokens, ref))}/{len(prompts)}"
        else:
            row["sampled_mean_acceptance_length"] = st.sampled_mean_acceptance_length
        out[k] = row
        print(f"  T={temperature} num_spec {k}: mean acceptance length {st.mean_acceptance_length:.2f}, per position "
              f"{[round(r, 3) for r in st.acceptance_rate_per_position]}, {st.rounds} rounds"
              + (f", same as num_spec 0: {row['same_tokens_as_num_spec_0']}" if temperature == 0 else
                 f", sampled {st.sampled_mean_acceptance_length:.2f}") + f" ({time.time() - t:.0f}s)", flush=True)
    return out


@torch.no_grad()
def draft_step_time(tgt, asst, n: int = 200) -> float:
    """Eager seconds per draft step of one request at position 128."""
    ids = list(range(97, 97 + 26)) * 5
    hidden, _, cache, starts, L = forward(tgt, [ids])
    p = torch.tensor([[len(ids) - 1]])
    h, kv, masks = A.rounds_input(tgt, hidden, cache, 1, L, p)
    e = tgt.embed(torch.tensor([ids[-1]])).view(1, 1, -1)
    for _ in range(10):
        asst.draft_logits(asst.step(e, h, p, kv, masks)[0]).argmax(-1)
    t = time.perf_counter()
    for _ in range(n):
        asst.draft_logits(asst.step(e, h, p, kv, masks)[0]).argmax(-1)
    return (time.perf_counter() - t) / n


def hf_check(target_dir: Path, asst_dir: Path, prompts: list[list[int]], new_tokens: int, num_spec: int) -> dict:
    """transformers: assisted greedy (batch 1, num_assistant_tokens = num_spec) == plain greedy;
    mtpkit greedy (no drafter) == transformers' greedy, tie-aware."""
    sys.path.insert(0, str(ROOT / "tests"))
    from oracle import check_greedy_against_hf
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    import mtpkit

    hft = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hfa = Gemma4AssistantForCausalLM.from_pretrained(asst_dir, dtype=torch.float32).eval()
    hfa.generation_config.num_assistant_tokens = num_spec
    same, t_plain, t_asst = 0, 0.0, 0.0
    for ids in prompts:
        x = torch.tensor([ids])
        kw = dict(max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        t = time.time()
        plain = hft.generate(x, **kw)[0, len(ids):].tolist()
        t_plain += time.time() - t
        t = time.time()
        assisted = hft.generate(x, assistant_model=hfa, **kw)[0, len(ids):].tolist()
        t_asst += time.time() - t
        same += plain == assisted
    llm = mtpkit.LLM(target_dir, dtype="float32", device="cpu", num_spec=0, max_num_seqs=len(prompts),
                     max_model_len=max(map(len, prompts)) + new_tokens + 8)
    outs = llm.generate(prompts, mtpkit.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    reports = [check_greedy_against_hf(hft, ids, o.token_ids) for ids, o in zip(prompts, outs)]
    res = {"prompts": len(prompts), "hf_assisted_equals_hf_greedy": same, "hf_greedy_s": t_plain,
           "hf_assisted_s": t_asst, "mtpkit_vs_hf_identical": sum(r.identical for r in reports),
           "mtpkit_vs_hf_ok": sum(r.ok for r in reports), "failures": [r.reason for r in reports if not r.ok]}
    print(f"transformers assisted (num_assistant_tokens {num_spec}) == plain greedy: {same}/{len(prompts)} "
          f"({t_plain:.1f}s plain, {t_asst:.1f}s assisted); mtpkit greedy vs transformers: "
          f"{res['mtpkit_vs_hf_identical']}/{len(prompts)} identical, {res['mtpkit_vs_hf_ok']} ok (tie-aware)",
          flush=True)
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ASSETS / "tiny-gemma4"))
    p.add_argument("--assistant", default=str(ASSETS / "tiny-gemma4-assistant"))
    p.add_argument("--compare", nargs="*", default=[], help="more assistants of the same target")
    p.add_argument("--windows", type=int, default=64, help="teacher-forced windows")
    p.add_argument("--window-len", type=int, default=512)
    p.add_argument("--depth", type=int, default=6, help="teacher-forced draft steps")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--num-spec", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-check", action="store_true")
    p.add_argument("--hf-prompts", type=int, default=8)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    tgt, _ = load_target(Path(a.target))
    assistants = {Path(d).name: load_assistant(Path(d), tgt).eval() for d in [a.assistant, *a.compare]}
    results = {"target": a.target, "assistants": [a.assistant, *a.compare]}
    if a.windows:
        t = time.time()
        windows = spaced_heldout_windows(a.windows, a.window_len + a.depth - 2)
        results["teacher_forced"] = tf = teacher_forced(tgt, assistants, windows, a.depth)
        print(f"teacher-forced ({tf['tokens']:.0f} tokens, {time.time() - t:.0f}s): next-token "
              f"{tf['ntp_bits_per_byte']:.3f} bits/byte, accuracy {tf['ntp_accuracy']:.4f}", flush=True)
        for name in assistants:
            print(f"  {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in tf[name].items()), flush=True)
    prompts = [ids for _, ids in heldout_prompts(a.prompts, a.prompt_len)]
    for name, asst in assistants.items():
        print(f"{name}: draft step {draft_step_time(tgt, asst) * 1e3:.2f} ms (eager, batch 1)", flush=True)
        results[name] = {"draft_step_ms": draft_step_time(tgt, asst) * 1e3}
        for temp in a.temperatures:
            key = "speculation" if temp == 0 else f"speculation_t{temp}"
            results[name][key] = speculation(tgt, asst, prompts, a.new_tokens, a.num_spec, temp, a.seed)
    if a.hf_check:
        results["hf_check"] = hf_check(Path(a.target), Path(a.assistant), prompts[:a.hf_prompts], a.new_tokens, 3)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
