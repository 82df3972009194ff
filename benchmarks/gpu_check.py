"""GPU check of the graph path (needs CUDA), in three parts:

1. Real Qwen3-Next layer shapes (fewer layers), random weights, fp32: CUDA graphs (captured
   verify + MTP proposal, padded to num_reqs_padded) give the tokens of enforce_eager for
   num_spec 0..3, at batches 1, 3 (padded to 4) and 27.
2. The embedded trained model (real acceptance), fp32: greedy output with MTP through CUDA
   graphs == greedy output without MTP (losslessness), with the acceptance length; then one
   engine built and run in debug mode (shapes checked at capture and when buffers are
   filled) and the last rows of its shape trace.
3. Decode step latency, CUDA graphs vs eager, bf16, at batch 1, 8, 32.
4. Gemma 4 at real widths (31B and 26B-A4B by default, --gemma-layers layers: sliding layers
   and the last one full), random weights: fp32 CUDA graphs vs enforce_eager tokens at the
   token-check batches (num_spec 0: Gemma 4 drafts only with its assistant, a later issue),
   then bf16 verify-step latency, graphs vs eager, at the latency batches.
5. FP8 checkpoints kept in FP8 (benchmarks/gpu_fp8.py): Qwen3-Next and Gemma 4 26B-A4B widths,
   the Triton block-scaled kernels against their torch reference, logits against the
   dequantized twin, weight bytes, the gpu_memory_utilization plan (profile run) and graphs vs
   eager tokens. Options --fp8-*.

    python benchmarks/gpu_check.py [--layers 4] [--experts 512] [--max-tokens 16]

Tokens are compared in fp32: random weights make near-ties among 151k logits common, and
in bf16 a graph's padded batch (other GEMM tilings, the MoE's fixed-shape path instead of
eager's grouped loop) rounds differently, which flips such ties without any bug. Weights are
random (load_format="dummy"): only config.json is written. Latency = median wall time of a
verify step (torch.cuda synchronised around the runner's execute) over a generation.
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_fp8  # noqa: E402
from roofline_configs import qwen3_next_config  # noqa: E402


def run(llm, prompts, max_tokens):
    """(token ids per prompt, median verify-step ms) of one greedy generation."""
    import torch
    from mtpkit import SamplingParams

    times = []
    execute = llm.runner.execute

    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)

    def timed(plan):
        sync()
        t = time.perf_counter()
        out = execute(plan)
        sync()
        if plan.kind.value == "verify":
            times.append(time.perf_counter() - t)
        return out

    llm.runner.execute = timed
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        del llm.runner.execute  # back to the class's method (a bound method kept on the
        # instance would be a reference cycle, and the engine's GPU memory would outlive `del`)
    return [o.token_ids for o in outs], statistics.median(times) * 1e3 if times else float("nan")


def first_difference(a, b) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((p for p, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return f"prompt {i}, token {j}: {x[max(0, j - 2):j + 2]} vs {y[max(0, j - 2):j + 2]}"
    return "none"


def prompts_for(b: int) -> list[list[int]]:
    return [[(17 * i + 31 * j + 5) % 151000 for j in range(8 + i % 5)] for i in range(b)]


def check_real_shapes(path, args) -> bool:
    import torch
    from mtpkit import LLM

    print(f"\n== 1. real layer shapes, {args.layers} layers, {args.experts} experts, random fp32 "
          f"weights: CUDA graphs vs enforce_eager ==", flush=True)
    ok = True
    for k in args.specs:
        common = dict(num_spec=k, dtype="float32", max_num_seqs=max(args.token_batches), max_model_len=512,
                      load_format="dummy", seed=0, device=args.device)
        eager = LLM(path, enforce_eager=True, **common)
        t = time.perf_counter()
        graph = LLM(path, **common)
        capture_s = time.perf_counter() - t
        for b in args.token_batches:
            te, _ = run(eager, prompts_for(b), args.max_tokens)
            tg, _ = run(graph, prompts_for(b), args.max_tokens)
            same = te == tg
            ok &= same
            n = graph.engine.capture_plan.dispatch(b)
            print(f"num_spec={k} batch={b:>2} (graph {n}): same tokens {same}"
                  + ("" if same else f"; first difference {first_difference(te, tg)}"), flush=True)
        print(f"  num_spec={k}: build + capture {capture_s:.1f} s; {graph.runner.graphs.describe()}; "
              f"acceptance length {graph.stats.mean_acceptance_length:.2f}", flush=True)
        del eager, graph
        gc.collect()
        torch.cuda.empty_cache()
    return ok


def check_tiny(args) -> bool:
    import mtpkit
    from mtpkit import LLM, SamplingParams

    print("\n== 2. embedded model (tiny-qwen3-next), fp32: MTP through CUDA graphs vs greedy without MTP ==",
          flush=True)
    prompts = ["def fibonacci(n):", "import os\n\ndef walk(", "class Stack:\n    def __init__(self):",
               "for i in range(", "    return sorted(", "def parse_args(argv):\n    ", "x = [", "# utils"]
    params = SamplingParams(max_tokens=args.tiny_tokens, ignore_eos=True)
    base = LLM("tiny-qwen3-next", num_spec=0, dtype="float32", device=args.device, max_num_seqs=8, enforce_eager=True)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    ok = True
    for k in (1, 3, 4):
        for eager in (False, True):
            llm = LLM("tiny-qwen3-next", num_spec=k, dtype="float32", device=args.device, max_num_seqs=8, enforce_eager=eager)
            t = time.perf_counter()
            got = [o.token_ids for o in llm.generate(prompts, params)]
            dt = time.perf_counter() - t
            same = got == ref
            ok &= same
            print(f"num_spec={k} {'eager ' if eager else 'graphs'}: same tokens as num_spec=0 {same}; "
                  f"acceptance length {llm.stats.mean_acceptance_length:.2f}; {dt:.2f} s"
                  + ("" if same else f"; first difference {first_difference(ref, got)}"), flush=True)
    with mtpkit.debug() as trace:
        llm = LLM("tiny-qwen3-next", num_spec=3, dtype="float32", device=args.device, max_num_seqs=4)
        captured = len(trace)
        got = [o.token_ids for o in llm.generate(prompts[:3], SamplingParams(max_tokens=8, ignore_eos=True))]
        same = got == [r[:8] for r in ref[:3]]
        ok &= same
        print(f"debug mode: {captured} checked calls during capture, {len(trace) - captured} in generation; "
              f"same tokens {same}; last step's trace:", flush=True)
        print(trace.table(last=6, args=False), flush=True)
    return ok


def latency(path, args) -> None:
    import torch
    from mtpkit import LLM

    print(f"\n== 3. verify-step latency, bf16, {args.layers} layers, {args.experts} experts ==", flush=True)
    print(f"{'num_spec':>8} {'batch':>5} {'eager ms/step':>13} {'graph ms/step':>13} {'speedup':>7}")
    for k in args.specs:
        common = dict(num_spec=k, dtype="bfloat16", max_num_seqs=max(args.batches), max_model_len=1024,
                      load_format="dummy", seed=0, device=args.device)
        eager, graph = LLM(path, enforce_eager=True, **common), LLM(path, **common)
        for b in args.batches:
            _, le = run(eager, prompts_for(b), args.max_tokens)
            _, lg = run(graph, prompts_for(b), args.max_tokens)
            print(f"{k:>8} {b:>5} {le:>13.2f} {lg:>13.2f} {le / lg:>7.2f}", flush=True)
        del eager, graph
        gc.collect()
        torch.cuda.empty_cache()


def gemma4_config(name: str, layers: int, vocab: int | None) -> dict:
    """tests/gemma4_shapes.py's real widths, `layers` layers (the last full, the rest
    sliding; KV-shared variants share the last half)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import gemma4_shapes
    raw = dict(gemma4_shapes.REAL[name], num_hidden_layers=layers,
               layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    if raw.get("num_kv_shared_layers"):
        raw["num_kv_shared_layers"] = layers // 2
        raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if vocab:
        raw["vocab_size"] = vocab
        raw["eos_token_id"] = None   # the real eos id lies outside a shrunk vocabulary
        if raw.get("hidden_size_per_layer_input"):
            raw["vocab_size_per_layer_input"] = vocab
    return raw


def check_gemma4(args) -> bool:
    import torch
    from mtpkit import LLM

    ok = True
    for name in args.gemma_variants:
        path = Path(tempfile.mkdtemp()) / f"gemma4-{name}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(gemma4_config(name, args.gemma_layers, args.gemma_vocab)))
        print(f"\n== 4. Gemma 4 {name} widths, {args.gemma_layers} layers, random weights ==", flush=True)
        common = dict(dtype="float32", max_num_seqs=max(args.token_batches), max_model_len=2048,
                      load_format="dummy", seed=0, device=args.device)
        eager, graph = LLM(path, enforce_eager=True, **common), LLM(path, **common)
        for b in args.token_batches:
            te, _ = run(eager, prompts_for(b), args.max_tokens)
            tg, _ = run(graph, prompts_for(b), args.max_tokens)
            same = te == tg
            ok &= same
            print(f"fp32 batch={b:>2}: graphs vs eager same tokens {same}"
                  + ("" if same else f"; first difference {first_difference(te, tg)}"), flush=True)
        del eager, graph
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None
        common.update(dtype="bfloat16", max_num_seqs=max(args.batches))
        eager, graph = LLM(path, enforce_eager=True, **common), LLM(path, **common)
        print(f"{'batch':>5} {'eager ms/step':>13} {'graph ms/step':>13} {'speedup':>7}")
        for b in args.batches:
            _, le = run(eager, prompts_for(b), args.max_tokens)
            _, lg = run(graph, prompts_for(b), args.max_tokens)
            print(f"{b:>5} {le:>13.2f} {lg:>13.2f} {le / lg:>7.2f}", flush=True)
        del eager, graph
        gc.collect()
        torch.cuda.empty_cache() if args.device == "cuda" else None
    return ok


def fp8_args(args) -> argparse.Namespace:
    """Part 5's options (--fp8-*) as gpu_fp8.py names them."""
    return argparse.Namespace(device=args.device, **{k[4:]: v for k, v in vars(args).items() if k.startswith("fp8_")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tiny-tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="latency batches")
    ap.add_argument("--token-batches", type=int, nargs="+", default=[1, 3, 27], help="token-check batches")
    ap.add_argument("--specs", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4], choices=[1, 2, 3, 4, 5],
                    help="run in the order given")
    ap.add_argument("--gemma-variants", nargs="+", default=["31B", "26B-A4B"], help="part 4: tests/gemma4_shapes.py")
    ap.add_argument("--gemma-layers", type=int, default=6)
    ap.add_argument("--gemma-vocab", type=int, default=None, help="part 4: a smaller vocabulary (CPU dry runs)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script's own logic")
    gpu_fp8.add_args(ap, prefix="fp8-")
    args = ap.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; this check needs a GPU", file=sys.stderr)
        return 2
    path = Path(tempfile.mkdtemp()) / "qwen3-next-real-shapes"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(qwen3_next_config(args.layers, args.experts)))
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"device {name}, torch {torch.__version__}", flush=True)
    ok = True
    parts = {1: lambda: check_real_shapes(path, args), 2: lambda: check_tiny(args), 3: lambda: latency(path, args),
             4: lambda: check_gemma4(args), 5: lambda: gpu_fp8.check_fp8(fp8_args(args))}
    for part in args.parts:   # in the order given (gpu_all.sh: what never ran first)
        fn = parts[part]
        try:
            ok &= fn() is not False
        except Exception:  # report and go on: one part failing should not hide the others
            import traceback
            traceback.print_exc()
            ok = False
    print("\ngpu_check:", "all checks passed" if ok else "FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
