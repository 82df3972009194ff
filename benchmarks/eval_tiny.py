"""Quality of the embedded tiny model on the held-out split of its corpus (training.train).

1. Teacher-forced, over fixed windows of the held-out stream: next-token loss (bits per byte)
   and accuracy; MTP pass-1 loss and accuracy (argmax of the MTP head at position t == the
   actual token t+2, the "position-1 acceptance"); and its agreement with the target's own
   greedy choice at t+1 (what greedy speculation actually needs).
2. Speculation, by running the engine: mtpkit.LLM greedy generation of `--new-tokens` tokens
   for `--prompts` held-out prompts of `--prompt-len` tokens, for num_spec 1..4, reading
   llm.stats.mean_acceptance_length; every run's tokens are compared with num_spec 0.

    python benchmarks/eval_tiny.py                      # the embedded model
    python benchmarks/eval_tiny.py --model DIR --json results.json
"""

import argparse
import math
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # training/ is not installed

import mtpkit
from mtpkit.kernels.ops import TORCH
from mtpkit.models.qwen3_next.config import Qwen3NextConfig
from mtpkit.checkpoint.loader import load_checkpoint
from mtpkit.models.qwen3_next.model import Qwen3NextForCausalLM
from mtpkit.checkpoint.hub import resolve_model
from training.corpus import heldout_prompts, spaced_heldout_windows as heldout_windows
from training.train import evaluate


def load_model(path: Path) -> Qwen3NextForCausalLM:
    model = Qwen3NextForCausalLM(Qwen3NextConfig.from_file(path), ops=TORCH, with_mtp=True)
    load_checkpoint(model, path, torch.float32, torch.device("cpu"))
    return model.eval()


@torch.inference_mode()
def teacher_forced(model: Qwen3NextForCausalLM, windows: torch.Tensor, batch: int = 8) -> dict:
    """training.train.evaluate's metrics, losses in bits per byte."""
    ev = evaluate(model, windows, batch)
    ln2 = math.log(2.0)
    return {"tokens": ev["tokens"], "ntp_bits_per_byte": ev["ntp"] / ln2, "ntp_accuracy": ev["ntp_acc"],
            "mtp1_bits_per_byte": ev["mtp1"] / ln2, "mtp1_accuracy": ev["mtp1_acc"],
            "mtp1_agrees_with_target_greedy": ev["mtp1_agree"]}


def speculation(path: Path, prompts: list[list[int]], new_tokens: int, num_specs: list[int],
                temperature: float = 0.0) -> dict:
    """Per num_spec: wall time, throughput, acceptance. Greedy runs must reproduce num_spec 0's
    tokens exactly; sampled runs (seeded per request) are compared only for their statistics."""
    params = mtpkit.SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=temperature)
    out, reference = {}, None
    for k in [0] + num_specs:
        llm = mtpkit.LLM(path, dtype="float32", device="cpu", num_spec=k, max_num_seqs=len(prompts),
                         max_model_len=max(len(p) for p in prompts) + new_tokens + 8, enforce_eager=True)
        t = time.time()
        res = llm.generate(prompts, params)
        wall = time.time() - t
        tokens = [r.token_ids for r in res]
        if reference is None:
            reference = tokens
        same = sum(a == b for a, b in zip(tokens, reference))
        s = llm.stats
        out[k] = {"wall_s": wall, "tokens_per_s": sum(map(len, tokens)) / wall}
        if temperature == 0:
            out[k]["same_tokens_as_num_spec_0"] = f"{same}/{len(prompts)}"
        if k:
            out[k].update(mean_acceptance_length=s.mean_acceptance_length,
                          acceptance_rate_per_position=s.acceptance_rate_per_position,
                          verify_steps=s.verify_steps)
        print(f"T={temperature} num_spec {k}: " + ", ".join(f"{a} {v:.3f}" if isinstance(v, float) else f"{a} {v}"
                                            for a, v in out[k].items() if a != "acceptance_rate_per_position")
              + (f", per position {[round(r, 3) for r in s.acceptance_rate_per_position]}" if k else ""),
              flush=True)
    return out


def hf_check(path: Path, prompts: list[list[int]], new_tokens: int, num_spec: int = 3) -> dict:
    """mtpkit greedy (float32, with speculation) against transformers' Qwen3NextForCausalLM
    greedy (float32) loaded from the same directory (it ignores mtp.*): tie-aware, as
    tests/oracle.py checks it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from oracle import check_greedy_against_hf, load_hf_model

    hf, info = load_hf_model(path, dtype=torch.float32, with_info=True)
    missing = list(info.get("missing_keys", []))
    llm = mtpkit.LLM(path, dtype="float32", device="cpu", num_spec=num_spec, max_num_seqs=len(prompts),
                     max_model_len=max(len(p) for p in prompts) + new_tokens + 8)
    outs = llm.generate(prompts, mtpkit.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    reports = [check_greedy_against_hf(hf, ids, o.token_ids) for ids, o in zip(prompts, outs)]
    res = {"hf_missing_keys": missing, "prompts": len(prompts), "identical": sum(r.identical for r in reports),
           "ok": sum(r.ok for r in reports), "failures": [r.reason for r in reports if not r.ok]}
    print(f"transformers vs mtpkit (num_spec {num_spec}) greedy: {res['identical']}/{len(prompts)} identical, "
          f"{res['ok']}/{len(prompts)} ok (tie-aware); HF missing keys: {missing or 'none'}", flush=True)
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen3-next", help="checkpoint dir or built-in name")
    p.add_argument("--windows", type=int, default=64, help="teacher-forced windows")
    p.add_argument("--window-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--num-spec", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7],
                   help="speculation runs: greedy (0) and sampled (seeded) temperatures")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--show", type=int, default=2, help="print this many generations")
    p.add_argument("--hf-check", action="store_true",
                   help="also compare mtpkit's greedy output with transformers' on the prompts")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    path = resolve_model(a.model)
    results = {"model": str(path)}
    if a.windows:
        t = time.time()
        tf = teacher_forced(load_model(path), heldout_windows(a.windows, a.window_len))
        print("teacher-forced: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in tf.items()) + f" ({time.time() - t:.0f}s)", flush=True)
        results["teacher_forced"] = tf
    prompts = heldout_prompts(a.prompts, a.prompt_len)
    results["prompts"] = [name for name, _ in prompts]
    if a.prompts:
        for t in a.temperatures:
            key = "speculation" if t == 0 else f"speculation_t{t}"
            results[key] = speculation(path, [ids for _, ids in prompts], a.new_tokens, a.num_spec, t)
        llm = mtpkit.LLM(path, dtype="float32", device="cpu", num_spec=3)
        for name, ids in prompts[:a.show]:
            text = llm.generate([ids], mtpkit.SamplingParams(max_tokens=a.new_tokens, ignore_eos=True))[0].text
            print(f"--- {name}: prompt\n{bytes(ids).decode('utf-8', 'replace')}\n--- generated\n{text}\n---",
                  flush=True)
    if a.hf_check:
        from tokenizers import Tokenizer
        fib = Tokenizer.from_file(str(path / "tokenizer.json")).encode("def fibonacci(n):").ids
        results["hf_check"] = hf_check(path, [fib] + [ids for _, ids in prompts], a.new_tokens)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
