"""How far one verify step (plus its MTP proposal) is from the memory-bandwidth bound.

For a config (random weights, `load_format="dummy"`: only config.json is needed), a batch size
and num_spec, it runs the engine to a steady decode step and reports:

- the bytes the step must move, by part (`step_bytes`): the weights every token multiplies, the
  experts the step's routing actually chose (each touched expert read once, however many tokens
  chose it), the embedding rows, the lm_head once per pass, the paged KV read and written, the
  GDN recurrent and conv state read and written, and the same for each MTP pass;
- the measured step time: CUDA-graph replay on GPU, the traced graph on CPU;
- the bound (GPU: bytes / the copy bandwidth measured here; CPU: none) and time / bound;
- a per-part breakdown: torch.profiler times of the step's bodies called directly, each op
  attributed to the innermost labelled part (attention, GDN, conv, MoE, norms, lm_head, other
  glue, sampling/rejection). On GPU these are kernel times, on CPU op times.

    python benchmarks/roofline.py --layers 4 --batch 1 --num-spec 3           # real shapes
    python benchmarks/roofline.py --layers 4 --experts 64 --batch 1 --device cpu

The byte model (what `step_bytes` counts), batch b, bundle B = num_spec + 1, context c tokens
already cached per request, T = b * B:
- target pass: non-expert weights once; per MoE layer the distinct experts chosen by the T real
  tokens (gate/up [2I, H] + down [H, I] each); T embedding rows; the lm_head once;
  per full-attention layer KV read for c + B positions and written for B, per request; per GDN
  layer the recurrent state read from one slot and written to B slots, the conv window read
  (W - 1 columns) and its slot written (W - 1 + num_spec columns), per request;
- MTP passes j = 1..num_spec: the MTP layer's non-expert weights, the experts its b rows chose,
  the lm_head; embedding rows and KV written: T in pass 1 (it writes every position of the
  step), b after; KV read c + j positions per request (the last accepted token at position c:
  no draft accepted, what random weights give).
Padded rows are left out: they are work the step does, not bytes it must move.
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mtpkit.models.moe import SparseMoE  # noqa: E402


def real_config(layers: int, experts: int = 512) -> dict:
    # Qwen/Qwen3-Next-80B-A3B-Instruct with fewer layers (3:1 GDN : full attention).
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


# ---- routing ---------------------------------------------------------------------------------
@contextlib.contextmanager
def record_routing(model, num_reqs: int, num_reqs_padded: int):
    """Records, per MoE module name, one tensor of chosen expert ids per call (its real rows:
    a call over num_reqs_padded * k rows keeps the first num_reqs * k). Patches `route` on
    the instances, so every MoE path (sparse, dense, grouped) is seen."""
    calls: dict[str, list[torch.Tensor]] = defaultdict(list)
    patched = []
    for name, m in model.named_modules():
        if isinstance(m, SparseMoE):
            def route(logits, _orig=m.route, _name=name):
                weights, experts = _orig(logits)
                per_row = experts.shape[0] // num_reqs_padded
                calls[_name].append(experts[:per_row * num_reqs].detach().cpu())
                return weights, experts
            m.route = route
            patched.append(m)
    try:
        yield calls
    finally:
        for m in patched:
            del m.route


# ---- bytes -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    batch: int
    num_spec: int
    context: int          # tokens cached per request before the step


def _moe_split(model) -> dict[str, tuple[int, int]]:
    """MoE module name -> (bytes of one expert, bytes of its non-expert weights)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, SparseMoE):
            isz, H, I, S = m.w13.element_size(), m.hidden, m.inter, m.shared_range[1]
            out[name] = (3 * I * H * isz, (m.w_in.numel() + H * S) * isz)
    return out


def step_bytes(model, cfg, step: Step, routing: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes one verify step and its num_spec MTP passes must move, by part (the byte model in
    this module's docstring). `routing`: per MoE module name, the expert ids of each call, in
    call order (the target layers once each; the MTP layer once per pass)."""
    b, k, c = step.batch, step.num_spec, step.context
    B, T = k + 1, step.batch * (k + 1)
    H = cfg.hidden_size
    isz = model.embed_tokens.element_size()
    moe = _moe_split(model)
    lm_head = (model.embed_tokens if model.lm_head is None else model.lm_head).numel() * isz
    out: dict[str, int] = defaultdict(int)

    skip = {"embed_tokens", "lm_head"}
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if name in skip or owner in moe:
            continue
        part = "mtp weights" if name.startswith("mtp.") else "weights"
        out[part] += p.numel() * p.element_size() * (k if part == "mtp weights" else 1)
    for name, (per_expert, dense) in moe.items():
        calls = routing.get(name, [])
        mtp = name.startswith("mtp.")
        passes = k if mtp else 1
        if len(calls) < passes:
            raise ValueError(f"routing for {name}: {len(calls)} calls recorded, the step makes {passes}")
        out["mtp weights" if mtp else "weights"] += dense * passes
        for experts in calls[:passes]:
            out["mtp experts" if mtp else "experts"] += int(torch.unique(experts).numel()) * per_expert
    out["embedding"] += T * H * isz
    out["lm_head"] += lm_head

    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * isz       # K and V of one position, one layer
    n_full, n_gdn = len(cfg.full_layers), len(cfg.linear_layers)
    out["kv read"] += n_full * b * (c + B) * kv_token
    out["kv written"] += n_full * T * kv_token
    state_isz = 8 if model.embed_tokens.dtype == torch.float64 else 4   # the recurrent state is fp32 (fp64 in fp64)
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_isz
    W, conv_dim = cfg.linear_conv_kernel_dim, cfg.conv_dim
    out["gdn state read"] += n_gdn * b * ssm
    out["gdn state written"] += n_gdn * T * ssm
    out["conv state read"] += n_gdn * b * conv_dim * (W - 1) * isz
    out["conv state written"] += n_gdn * b * conv_dim * (W - 1 + k) * isz

    if k:
        out["mtp embedding"] += (T + (k - 1) * b) * H * isz
        out["mtp lm_head"] += k * lm_head
        out["mtp kv written"] += (T + (k - 1) * b) * kv_token
        out["mtp kv read"] += sum(b * (c + j) * kv_token for j in range(1, k + 1))
    return dict(out)


# ---- the engine at a steady decode step ------------------------------------------------------
def build(path: Path, args, device: str):
    from mtpkit import LLM
    return LLM(str(path), num_spec=args.num_spec, dtype=args.dtype, max_num_seqs=args.batch,
               max_model_len=args.context + 64, load_format="dummy", seed=0, device=device,
               graph_sizes=[args.batch], num_threads=args.threads)


def steady_step(llm, args):
    """Queues `batch` requests with prompts of `context` tokens and steps until a verify step
    has run (each replay after it reruns that step: the buffers keep its rows)."""
    from mtpkit import SamplingParams
    g = llm.runner.graphs
    if g is None:
        raise SystemExit("roofline.py needs the graph path (not enforce_eager, debug mode or tensor parallelism)")
    g.trace_after = 0
    V = llm.model.cfg.vocab_size
    for i in range(args.batch):
        llm.add_request([(31 * i + 7 * j + 3) % V for j in range(args.context)],
                        SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(4 * args.batch + 8):
        llm.step()
        if g._last is not None:
            return g
    raise RuntimeError("no verify step ran")


def body_calls(g, batch: int):
    """(verify, propose) as direct calls of the bodies the graphs hold, on the buffers' rows."""
    last = g._last
    n, ctx = last.num_reqs_padded, last.max_seq_len
    state = {}

    def verify():
        state["hidden"], state["logits"] = g._verify_body(ctx, *g._verify_args(n))

    def propose():
        return g._propose_body(ctx, *g._propose_args(n, state["hidden"]))
    return verify, (propose if g.drafter is not None else None), state


def replays(g):
    """(verify, propose) replaying the captured (CUDA) or traced (CPU) graphs."""
    last = g._last
    n = last.num_reqs_padded
    if g.cuda:
        return g.verify_graphs[n].replay, (g.propose_graphs[n].replay if g.drafter is not None else None)
    key = (n, last.traced_context)
    verify, propose = g.verify_graphs[key], g.propose_graphs[key]
    args = g._verify_args(n)
    out = {}

    def v():
        out["hidden"], _ = verify(*args)

    def p():
        return propose(*g._propose_args(n, out["hidden"]))
    v()
    return v, (p if propose is not None else None)


def time_ms(fns, device: torch.device, reps: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        for f in fns:
            f()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        for f in fns:
            f()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def copy_bandwidth(device: torch.device) -> float | None:
    """GB/s of a 1 GiB device-to-device copy (read + write), or None on CPU (no bound there)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms([lambda: dst.copy_(src)], device, 20)
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


# ---- breakdown -------------------------------------------------------------------------------
PARTS = ("attention", "GDN", "conv", "MoE", "norms", "lm_head", "sampling/rejection")
OTHER = "other (embedding, residuals, glue)"


@contextlib.contextmanager
def labelled(model):
    """Every module and op of a part runs inside record_function("part:<name>")."""
    from mtpkit.models.layers import MLP, GatedRMSNorm, RMSNorm
    from mtpkit.models.qwen3_next import FullAttention, GatedDeltaNet

    def wrap(fn, label):
        def inner(*a, **kw):
            with torch.profiler.record_function("part:" + label):
                return fn(*a, **kw)
        return inner

    kinds = {FullAttention: "attention", GatedDeltaNet: "GDN", SparseMoE: "MoE", MLP: "MoE",
             RMSNorm: "norms", GatedRMSNorm: "norms"}
    undo = []
    for m in model.modules():
        label = next((v for t, v in kinds.items() if isinstance(m, t)), None)
        if label:
            m.forward = wrap(m.forward, label)
            undo.append((m, "forward"))
        if isinstance(m, GatedDeltaNet):
            ops = m.ops
            m.ops = dataclasses.replace(ops, causal_conv1d_verify=wrap(ops.causal_conv1d_verify, "conv"))
            undo.append((m, "ops", ops))
    model.compute_logits = wrap(model.compute_logits, "lm_head")
    undo.append((model, "compute_logits"))
    try:
        yield wrap
    finally:
        for m, attr, *old in reversed(undo):
            if old:
                setattr(m, attr, old[0])
            else:
                delattr(m, attr)


def breakdown(llm, g, batch: int, reps: int = 3) -> dict[str, float]:
    """ms per step by part: the bodies called directly under the profiler (each MoE on its
    fixed-shape path, as in a graph), plus one rejection sample of the verify logits."""
    from torch.profiler import ProfilerActivity, profile
    from mtpkit.speculative.rejection import rejection_sample
    from mtpkit import SamplingParams

    cuda = g.cuda
    model = llm.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m in moes:
        m.dense_limit = 1 << 62
    verify, propose, state = body_calls(g, batch)
    n, B = g._last.num_reqs_padded, g.bundle
    sampling = llm.runner._sampling([SamplingParams()] * batch)

    def sample():
        logits = state["logits"].view(n, B, -1)[:batch]
        drafts = g.buf.token_ids[:n * B].view(n, B)[:batch, 1:]
        limit = torch.full((batch,), B - 1, dtype=torch.int64, device=logits.device)
        rejection_sample(logits, drafts, limit, sampling, [0] * batch, [1] * batch)

    try:
        with labelled(model) as wrap:
            steps = [verify, wrap(sample, "sampling/rejection")] + ([propose] if propose else [])
            for f in steps:  # warm-up
                f()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch.inference_mode(), profile(activities=acts) as prof:
                for _ in range(reps):
                    for f in steps:
                        f()
                if cuda:
                    torch.cuda.synchronize()
    finally:
        for m in moes:
            del m.dense_limit
    totals: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        label, p = None, ev
        while p is not None:
            if p.name.startswith("part:"):
                label = p.name[5:]
                break
            p = p.cpu_parent
        t = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        totals[label or OTHER] += t / 1e3 / reps
    return dict(totals)


# ---- main ------------------------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--config", type=Path, help="a config.json to use instead of the real shapes")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-spec", type=int, default=0)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cfg = json.loads(args.config.read_text()) if args.config else real_config(args.layers, args.experts)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(json.dumps(cfg))
        llm = build(path, args, device.type)
    g = steady_step(llm, args)
    context = max(g.buf.seq_lens[:args.batch].tolist()) - g.bundle   # tokens cached before the step
    verify, propose, _ = body_calls(g, args.batch)
    with torch.inference_mode(), record_routing(llm.model, args.batch, g._last.num_reqs_padded) as routing:
        verify()
        if propose:
            propose()
    nbytes = step_bytes(llm.model, llm.model.cfg, Step(args.batch, args.num_spec, context), routing)
    total = sum(nbytes.values())

    with torch.inference_mode():
        rv, rp = replays(g)
        verify_ms = time_ms([rv], device, args.reps)
        step_ms = time_ms([rv] + ([rp] if rp else []), device, args.reps)
    bw = copy_bandwidth(device)
    parts = breakdown(llm, g, args.batch)

    kind = "CUDA graph" if g.cuda else "traced graph"
    print(f"== {cfg.get('num_hidden_layers')} layers, {cfg.get('num_experts')} experts, {args.dtype}, "
          f"batch {args.batch}, num_spec {args.num_spec}, context {context} ({device}) ==")
    print("bytes one step must move:")
    for k, v in sorted(nbytes.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<20} {v / 1e6:12.3f} MB")
    print(f"  {'total':<20} {total / 1e6:12.3f} MB")
    print(f"step time ({kind} replay, median of {args.reps}): verify {verify_ms:.3f} ms, "
          f"verify + proposal {step_ms:.3f} ms")
    result = dict(config=cfg, batch=args.batch, num_spec=args.num_spec, context=context, dtype=args.dtype,
                  device=str(device), bytes=nbytes, total_bytes=total, verify_ms=verify_ms, step_ms=step_ms,
                  breakdown_ms=parts)
    if bw:
        bound_ms = total / (bw * 1e9) * 1e3
        verify_bytes = sum(v for k, v in nbytes.items() if not k.startswith("mtp "))
        verify_bound_ms = verify_bytes / (bw * 1e9) * 1e3
        print(f"copy bandwidth {bw:.0f} GB/s; verify: bound {verify_bound_ms:.3f} ms, time / bound "
              f"{verify_ms / verify_bound_ms:.2f}x; verify + proposal: bound {bound_ms:.3f} ms, time / bound "
              f"{step_ms / bound_ms:.2f}x")
        result |= dict(bandwidth_gbs=bw, bound_ms=bound_ms, ratio=step_ms / bound_ms,
                       verify_bound_ms=verify_bound_ms, verify_ratio=verify_ms / verify_bound_ms)
    else:
        print("bound: none on CPU (no copy bandwidth to divide by)")
    print("breakdown (bodies called directly under torch.profiler, ms per step"
          + (", kernel time" if g.cuda else ", CPU op time") + "):")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<36} {v:9.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
