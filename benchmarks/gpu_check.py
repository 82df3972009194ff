"""GPU check of the graph path (needs CUDA): captures the verify/propose graphs for a
random-weight model with real Qwen3-Next layer shapes (fewer layers), checks graph tokens ==
eager tokens for num_spec 0..3, and prints decode step latency graph vs eager at batch 1, 8, 32.

    python benchmarks/gpu_check.py [--layers 4] [--experts 512] [--max-tokens 24]

Weights are random (load_format="dummy"): only config.json is written, so the check costs
seconds, not a multi-GB checkpoint. Latency = median wall time of a verify step (torch.cuda
synchronised), measured by timing the runner's execute calls of VERIFY steps.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def real_config(layers: int, experts: int) -> dict:
    # Qwen/Qwen3-Next-80B-A3B-Instruct, fewer layers (3:1 GDN : full attention).
    return dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                num_hidden_layers=layers, full_attention_interval=4, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, intermediate_size=5120,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=experts,
                num_experts_per_tok=10, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                tie_word_embeddings=False, eos_token_id=151645, dtype="bfloat16")


def step_latencies(llm, prompts, max_tokens):
    import torch
    from mtpkit import SamplingParams

    times = []
    execute = llm.runner.execute

    def timed(plan):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = execute(plan)
        torch.cuda.synchronize()
        if plan.kind.value == "verify":
            times.append(time.perf_counter() - t)
        return out

    llm.runner.execute = timed
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    llm.runner.execute = execute
    return [o.token_ids for o in outs], statistics.median(times) * 1e3 if times else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--specs", type=int, nargs="+", default=[0, 1, 2, 3])
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; this check needs a GPU", file=sys.stderr)
        return 2
    from mtpkit import LLM

    path = Path(tempfile.mkdtemp()) / "qwen3-next-real-shapes"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(real_config(args.layers, args.experts)))
    print(f"device {torch.cuda.get_device_name()}; {args.layers} layers, {args.experts} experts, "
          f"random bf16 weights", flush=True)
    ok = True
    print(f"{'num_spec':>8} {'batch':>5} {'same tokens':>11} {'eager ms/step':>13} {'graph ms/step':>13} {'speedup':>7}")
    for k in args.specs:
        common = dict(num_spec=k, dtype="bfloat16", max_num_seqs=max(args.batches), max_model_len=1024,
                      load_format="dummy", seed=0)
        eager = LLM(path, enforce_eager=True, **common)
        t = time.perf_counter()
        graph = LLM(path, **common)
        capture_s = time.perf_counter() - t
        for b in args.batches:
            prompts = [[(17 * i + j) % 151000 for j in range(8 + i % 5)] for i in range(b)]
            te, le = step_latencies(eager, prompts, args.max_tokens)
            tg, lg = step_latencies(graph, prompts, args.max_tokens)
            same = te == tg
            ok &= same
            print(f"{k:>8} {b:>5} {str(same):>11} {le:>13.2f} {lg:>13.2f} {le / lg:>7.2f}", flush=True)
        print(f"         (num_spec={k}: build + capture {capture_s:.1f} s; {graph.runner.graphs.describe()})")
        del eager, graph
        torch.cuda.empty_cache()
    print("graph tokens == eager tokens:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
