"""GPU check of FP8 checkpoints kept in FP8 (part 5 of gpu_check.py; also runs alone).

For each model (Qwen3-Next-80B's layer widths, and Gemma 4 26B-A4B's, whose 704-row experts
cut the 128-row blocks so their rows name their scale rows; fewer layers and experts, a
smaller vocabulary): random weights (mtpkit's dummy init) written as a real fine-grained FP8
checkpoint (weight_block_size [128, 128], float8_e4m3fn weights with float32
weight_scale_inv; routers, embeddings, norms unquantized) and as its dequantized twin (fp32
values, exact: loaded as bf16 it is the dequantized-bf16 twin).
Then, on the device:

1. the FP8 checkpoint loaded with its weights kept in FP8 (the CUDA default) runs the Triton
   block-scaled kernels; its logits against the same model through the kernels' torch
   reference (same arithmetic: only summation order differs, so close to bf16 rounding) and
   against the dequantized twin (the activations' FP8 rounding: reported);
2. weight bytes kept vs the twin's, and the memory plan of `gpu_memory_utilization` (the
   profile run measures the activations; CPU: `memory_budget` instead);
3. greedy tokens through CUDA graphs (FP8 kernels captured) equal eager's.

    python benchmarks/gpu_fp8.py [--layers 2] [--experts 32] [--vocab 32768]
    python benchmarks/gpu_fp8.py --device cpu --widths tiny      # the CPU-side logic (tests)
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's mtpkit

BLOCK = (128, 128)
NOT_CONVERTED = ["lm_head", "embed_tokens", "mlp.gate", "mlp.shared_expert_gate", "router"]


def qwen_config(layers: int, experts: int, vocab: int, tiny: bool) -> dict:
    """Qwen3-Next-80B-A3B's widths (benchmarks/roofline_configs.py), `layers` layers (the last full
    attention, the others GDN); `tiny`: small widths for a CPU dry run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from roofline_configs import qwen3_next_config
    raw = qwen3_next_config(layers, experts)
    # eos None: the real eos id lies outside a shrunk vocabulary (a ConfigError).
    raw.update(vocab_size=vocab, layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
               num_nextn_predict_layers=1, max_position_embeddings=4096, eos_token_id=None)
    raw.pop("full_attention_interval")
    if tiny:
        raw.update(hidden_size=256, num_attention_heads=4, head_dim=64, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                   moe_intermediate_size=192, shared_expert_intermediate_size=128, num_experts_per_tok=2)
    return raw


def gemma_config(layers: int, experts: int, vocab: int, tiny: bool) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import gemma4_shapes
    raw = dict(gemma4_shapes.REAL["26B-A4B"], num_hidden_layers=layers, vocab_size=vocab,
               num_experts=experts, top_k_experts=min(8, experts), max_position_embeddings=4096,
               layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    if tiny:
        raw.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1,
                   head_dim=64, global_head_dim=128, intermediate_size=320, moe_intermediate_size=176, top_k_experts=2)
    return raw


def _quantizable(name: str, t: torch.Tensor) -> bool:
    fused = name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and t.dim() == 3
    return ((name.endswith(".weight") and t.dim() == 2 or fused) and "norm" not in name and "conv1d" not in name
            and not any(f".{m}." in f".{name}" for m in NOT_CONVERTED))


def write_pair(raw: dict, root: Path, device: str, num_spec: int) -> tuple[Path, Path, int]:
    """(fp8 dir, twin dir, FP8 weight elements): random weights exported by mtpkit under the
    checkpoint's names, quantized per 128 x 128 block; the twin holds their dequantized values."""
    from safetensors.torch import save_file

    from mtpkit import LLM
    from mtpkit.kernels.fp8_matmul import dequantize, quantize
    from mtpkit.checkpoint.loader import export_state_dict

    src = root / "config-only"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(raw))
    model = LLM(src, num_spec=num_spec, load_format="dummy", device=device, dtype="bfloat16", max_model_len=64,
                max_num_seqs=1, enforce_eager=True).model
    fp8, twin, elements = {}, {}, 0
    for name, t in export_state_dict(model).items():
        t = t.contiguous()
        if _quantizable(name, t):
            q, s = quantize(t.float(), BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q.cpu(), s.cpu()
            twin[name] = dequantize(q, s, BLOCK, torch.float32).cpu()   # exact; loaded as the model dtype
            elements += q.numel()
        else:
            fp8[name] = twin[name] = t.to(torch.bfloat16).cpu()
    del model
    gc.collect()
    out = []
    for kind, tensors in (("fp8", fp8), ("twin", twin)):
        d = root / kind
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(raw, dtype="bfloat16")
        if kind == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": list(BLOCK), "modules_to_not_convert": NOT_CONVERTED}
        (d / "config.json").write_text(json.dumps(cfg))
        out.append(d)
    return out[0], out[1], elements


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check_model(name: str, raw: dict, args) -> bool:
    from mtpkit import LLM, SamplingParams
    from mtpkit.kernels.ops import TORCH
    from mtpkit.layers.fp8_layout import FP8Matrix

    num_spec = 2 if raw["model_type"] == "qwen3_next" else 0
    t0 = time.perf_counter()
    fp8_dir, twin_dir, elements = write_pair(raw, Path(tempfile.mkdtemp()) / name, args.device, num_spec)
    print(f"\n== 5. FP8 {name}: {raw['num_hidden_layers']} layers, {raw.get('num_experts')} experts, "
          f"{elements / 1e6:.1f}M FP8 weights written in {time.perf_counter() - t0:.1f} s ==", flush=True)
    common = dict(num_spec=num_spec, device=args.device, dtype="bfloat16", max_model_len=512, max_num_seqs=4)
    prompt = [(37 * i + 11) % raw["vocab_size"] for i in range(args.prompt_len)]
    # fp32: the kernels against their torch reference on the same model (only the summation
    # order differs, so they agree to fp32 rounding unless a near-tie flips a routing choice)
    kept32 = LLM(fp8_dir, keep_fp8=True, enforce_eager=True, **dict(common, dtype="float32"))
    got = kept32.score(prompt)
    # The same model with its FP8 matrices' kernels (Ops.fp8_linear / fp8_batched) swapped for
    # the torch backend's references; every other kernel unchanged.
    mats32 = [m for m in kept32.model.modules() if isinstance(m, FP8Matrix)]
    kernels = [m.ops for m in mats32]
    for m in mats32:
        m.ops = TORCH
    try:
        ref = kept32.score(prompt)
    finally:
        for m, ops in zip(mats32, kernels):
            m.ops = ops
    del kept32
    kernel_err = _rel(got, ref)
    ok = kernel_err < 1e-3
    print(f"fp32 logits, kernels vs torch reference: rel err {kernel_err:.2e} (pass < 1e-3)", flush=True)
    kept = LLM(fp8_dir, keep_fp8=True, enforce_eager=True, **common)
    mats = [m for m in kept.model.modules() if isinstance(m, FP8Matrix)]
    held = sum(p.numel() for p in kept.model.parameters() if p.dtype == torch.float8_e4m3fn)
    print(f"kept: {held / 1e6:.1f}M FP8 weights in {len(mats)} FP8 matrices "
          f"({sum(m.scale_rows is not None for m in mats)} with named scale rows); checkpoint {elements / 1e6:.1f}M",
          flush=True)
    ok &= held == elements
    got = kept.score(prompt)
    twin = LLM(twin_dir, enforce_eager=True, **common)
    want = twin.score(prompt)
    exact = LLM(twin_dir, enforce_eager=True, **dict(common, dtype="float32")).score(prompt)
    print(f"bf16 logits vs the dequantized twin: rel err {_rel(got, want):.2e} (the activations' FP8 rounding), "
          f"argmax agreement {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.2f}; vs the fp32 twin "
          f"{_rel(got, exact):.2e} (the bf16 twin's own: {_rel(want, exact):.2e})", flush=True)
    wb = lambda llm: sum(p.numel() * p.element_size() for p in llm.model.parameters())  # noqa: E731
    print(f"weight bytes: kept {wb(kept) / 2**20:.1f} MiB, twin {wb(twin) / 2**20:.1f} MiB "
          f"({wb(kept) / wb(twin):.2f}x)", flush=True)
    del kept, twin
    gc.collect()
    budget = (dict(gpu_memory_utilization=args.utilization) if args.device == "cuda"
              else dict(memory_budget=args.cpu_budget))
    planned = LLM(fp8_dir, keep_fp8=True, **budget, **common)   # prints the plan (CUDA: after the profile run)
    plan = planned.memory_plan
    print(f"plan: {plan.activation_source} activations {plan.activation_bytes / 2**20:.1f} MiB, "
          f"{plan.num_blocks} KV blocks, {plan.num_slots} state slots, {plan.max_concurrent} requests at "
          f"max_model_len", flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [prompt[: 5 + 3 * i] for i in range(3)]
    graphs = [o.token_ids for o in planned.generate(prompts, params)]
    del planned
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    eager = LLM(fp8_dir, keep_fp8=True, enforce_eager=True, **budget, **common)
    eager = [o.token_ids for o in eager.generate(prompts, params)]
    same = graphs == eager
    ok &= same
    print(f"greedy tokens, graphs vs eager (kept FP8): same {same}", flush=True)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return ok


def check_fp8(args) -> bool:
    tiny = args.widths == "tiny"
    ok = True
    for name in args.models:
        raw = (qwen_config(args.layers, args.experts, args.vocab, tiny) if name == "qwen3-next" else
               gemma_config(args.layers, args.experts, args.vocab, tiny))
        ok &= check_model(name, raw, args)
    return ok


def add_args(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    ap.add_argument(f"--{prefix}layers", type=int, default=2, help="FP8 models' layers (the last full attention)")
    ap.add_argument(f"--{prefix}experts", type=int, default=32)
    ap.add_argument(f"--{prefix}vocab", type=int, default=32768)
    ap.add_argument(f"--{prefix}models", nargs="+", default=["qwen3-next", "gemma4-26b-a4b"])
    ap.add_argument(f"--{prefix}widths", choices=["real", "tiny"], default="real")
    ap.add_argument(f"--{prefix}utilization", type=float, default=0.5, help="gpu_memory_utilization of the plan")
    ap.add_argument(f"--{prefix}cpu-budget", type=int, default=512 << 20, help="CPU: memory_budget of the plan")
    ap.add_argument(f"--{prefix}prompt-len", type=int, default=24)
    ap.add_argument(f"--{prefix}max-tokens", type=int, default=8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_fp8: CUDA is not available; this check needs a GPU (or --device cpu)", file=sys.stderr)
        return 2
    ok = check_fp8(args)
    print("\ngpu_fp8:", "ok" if ok else "FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
