"""How far one verify step (plus its drafting) is from the memory-bandwidth bound.

For a config (random weights, `load_format="dummy"`: only config.json is needed), a batch size
and num_spec, it runs the engine to a steady decode step and reports:

- the bytes the step must move, by part (`step_bytes`; the byte model, Qwen3-Next's and Gemma
  4's, is roofline_bytes.py's docstring): the weights every token multiplies, the experts the
  step's routing actually chose (each touched expert read once, however many tokens chose it),
  the embedding rows, the lm_head once per pass, the paged KV read and written (a sliding
  layer only its window), the GDN recurrent and conv state read and written, and the drafting:
  Qwen3-Next's MTP passes, or Gemma 4's assistant (its weights, its centroid head's rows, its
  reads of the target's KV) per draft step;
- the measured step time: CUDA-graph replay on GPU, the traced graph on CPU;
- the bound (GPU: bytes / the copy bandwidth measured here; CPU: none) and time / bound;
- a per-part breakdown: torch.profiler times of the step's bodies called directly, each op
  attributed to the innermost labelled part (attention, GDN, conv, MoE, MLP, norms, lm_head,
  the drafter's parts, other glue, sampling/rejection). On GPU these are kernel times, on CPU
  op times.

    python benchmarks/roofline.py --layers 4 --batch 1 --num-spec 3           # Qwen3-Next, real shapes
    python benchmarks/roofline.py --layers 4 --experts 64 --batch 1 --device cpu
    python benchmarks/roofline.py --model gemma4-26b-a4b --layers 6 --batch 1 --num-spec 3
    python benchmarks/roofline.py --model gemma4-31b --layers 6 --context 2048 --num-spec 0

`--model gemma4-31b` / `gemma4-26b-a4b`: the real layer shapes (roofline_configs.py) with
`--layers` layers in the 5:1 sliding:full pattern (the last full); with num_spec > 0 the
drafter is a random-weight assistant of assumed sizes (roofline_configs.ASSISTANT) or the
config.json given by --assistant-config. `--vocab` shrinks the vocabulary (CPU runs).
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

from mtpkit.layers.moe import SparseMoE  # noqa: E402
from roofline_bytes import DRAFT_PREFIXES, Step, record_routing, step_bytes  # noqa: E402,F401
from roofline_configs import MODELS, assistant_config, gemma4_config, qwen3_next_config  # noqa: E402


# ---- the engine at a steady decode step ------------------------------------------------------
def build(path: Path, args, device: str, draft_model: Path | None = None):
    """The engine on random weights; `draft_model`: the drafter's checkpoint directory (the
    Gemma 4 assistant), None for the family's own (Qwen3-Next's MTP head) or none."""
    from mtpkit import LLM
    return LLM(str(path), num_spec=args.num_spec, draft_model=draft_model, dtype=args.dtype, max_num_seqs=args.batch,
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
        state["hidden"], state["logits"] = g._verify_fn(ctx)(*g._verify_args(n))[:2]

    def propose():
        return g._propose_fn(ctx)(*g._propose_args(n, state["hidden"]))
    return verify, (propose if g.bodies.has_drafter else None), state


def replays(g):
    """(verify, propose) replaying the captured (CUDA) or traced (CPU) graphs."""
    last = g._last
    n = last.num_reqs_padded
    if g.cuda:
        return g.verify_graphs[n].replay, (g.propose_graphs[n].replay if g.bodies.has_drafter else None)
    key = (n, last.traced_context)
    verify, propose = g.verify_graphs[key], g.propose_graphs[key]
    args = g._verify_args(n)
    out = {}

    def v():
        out["hidden"] = verify(*args)[0]

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
PARTS = ("attention", "GDN", "conv", "MoE", "MLP", "norms", "per-layer embeddings", "lm_head",
         "drafter attention", "drafter MLP", "drafter norms", "drafter lm_head", "drafter (other)",
         "sampling/rejection")
OTHER = "other (embedding, residuals, glue)"


def _kinds() -> dict[type, str]:
    """Module class -> part, the first match wins (subclasses before their bases)."""
    from mtpkit.models.gemma4.model import Attention, GemmaRMSNorm, Router
    from mtpkit.models.gemma4.assistant import MaskedEmbedding, QOnlyAttention
    from mtpkit.layers.mlp import MLP
    from mtpkit.layers.norm import GatedRMSNorm, RMSNorm
    from mtpkit.models.qwen3_next.model import FullAttention, GatedDeltaNet
    return {FullAttention: "attention", Attention: "attention", QOnlyAttention: "attention",
            GatedDeltaNet: "GDN", SparseMoE: "MoE", Router: "MoE", MLP: "MLP",
            RMSNorm: "norms", GatedRMSNorm: "norms", GemmaRMSNorm: "norms", MaskedEmbedding: "lm_head"}


@contextlib.contextmanager
def labelled(model, drafter=None):
    """Every module and op of a part runs inside record_function("part:<name>"): the model's
    modules by kind (a Qwen3-Next MTP layer's too), a separate drafter module's (the Gemma 4
    assistant's) as "drafter <kind>", and the drafter's proposal as a whole as
    "drafter (other)" (what its labelled modules leave: projections, embedding rows, the KV
    slots it gathers, a full-vocabulary head)."""
    from mtpkit.models.qwen3_next.model import GatedDeltaNet

    def wrap(fn, label):
        def inner(*a, **kw):
            with torch.profiler.record_function("part:" + label):
                return fn(*a, **kw)
        return inner

    kinds, undo = _kinds(), []

    def patch(obj, attr, label):
        setattr(obj, attr, wrap(getattr(obj, attr), label))
        undo.append((obj, attr))

    assistant = getattr(drafter, "assistant", None)
    for root, prefix in ((model, ""), (assistant, "drafter ")):
        for m in (root.modules() if root is not None else ()):
            label = next((v for t, v in kinds.items() if isinstance(m, t)), None)
            if label:
                # A centroid head is called through argmax, not forward.
                patch(m, "argmax" if label == "lm_head" else "forward", prefix + label)
            if isinstance(m, GatedDeltaNet):
                ops = m.ops
                m.ops = dataclasses.replace(ops, causal_conv1d_verify=wrap(ops.causal_conv1d_verify, "conv"))
                undo.append((m, "ops", ops))
    patch(model, "compute_logits", "lm_head")
    if getattr(model, "ple_dim", 0):
        patch(model, "per_layer_inputs", "per-layer embeddings")
    if drafter is not None:
        patch(drafter, "propose", "drafter (other)")
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
    from mtpkit.sampling.rejection import rejection_sample
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
        with labelled(model, llm.drafter) as wrap:
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
def configs(args) -> tuple[dict, dict | None]:
    """(target config.json, the assistant's config.json or None) for the arguments."""
    cfg = json.loads(args.config.read_text()) if args.config else (
        qwen3_next_config(args.layers, args.experts) if args.model == "qwen3-next"
        else gemma4_config(args.model, args.layers, args.vocab))
    if args.vocab and args.config is None and args.model == "qwen3-next":
        cfg["vocab_size"] = args.vocab
        cfg["eos_token_id"] = None   # the real eos id lies outside a shrunk vocabulary
    gemma = cfg.get("model_type") in ("gemma4", "gemma4_text")
    if not gemma or args.num_spec == 0:
        if args.assistant_config:
            raise SystemExit("--assistant-config drafts for a Gemma 4 target at num_spec > 0")
        return cfg, None
    if args.assistant_config:
        return cfg, json.loads(args.assistant_config.read_text())
    return cfg, assistant_config(cfg.get("text_config", cfg))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default="qwen3-next", help="real layer shapes of this model")
    ap.add_argument("--layers", type=int, default=None, help="default: 4 (Qwen3-Next), 6 (Gemma 4: 5 sliding, 1 full)")
    ap.add_argument("--experts", type=int, default=512, help="Qwen3-Next's expert count")
    ap.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary than the real one (CPU runs)")
    ap.add_argument("--config", type=Path, help="a config.json to use instead of the real shapes")
    ap.add_argument("--assistant-config", type=Path, help="Gemma 4: the assistant's config.json (default: "
                    "roofline_configs.ASSISTANT's assumed sizes)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-spec", type=int, default=0)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, help="write this run's result")
    ap.add_argument("--jsonl", type=Path, help="append this run's result as one line (one file for many runs)")
    args = ap.parse_args(argv)
    args.layers = args.layers or (4 if args.model == "qwen3-next" else 6)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cfg, draft_cfg = configs(args)

    with tempfile.TemporaryDirectory() as tmp:
        path, draft = Path(tmp) / "target", None
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        if draft_cfg is not None:
            draft = Path(tmp) / "assistant"
            draft.mkdir()
            (draft / "config.json").write_text(json.dumps(draft_cfg))
        llm = build(path, args, device.type, draft)
    assistant = getattr(llm.drafter, "assistant", None)
    g = steady_step(llm, args)
    context = max(g.buf.seq_lens[:args.batch].tolist()) - g.bundle   # tokens cached before the step
    verify, propose, _ = body_calls(g, args.batch)
    with torch.inference_mode(), record_routing(llm.model, args.batch, g._last.num_reqs_padded,
                                                assistant) as routing:
        verify()
        if propose:
            propose()
    nbytes = step_bytes(llm.model, llm.model.cfg, Step(args.batch, args.num_spec, context), routing, assistant)
    total = sum(nbytes.values())

    with torch.inference_mode():
        rv, rp = replays(g)
        verify_ms = time_ms([rv], device, args.reps)
        step_ms = time_ms([rv] + ([rp] if rp else []), device, args.reps)
    bw = copy_bandwidth(device)
    parts = breakdown(llm, g, args.batch)

    kind = "CUDA graph" if g.cuda else "traced graph"
    mcfg = llm.model.cfg
    name = args.config.name if args.config else args.model
    drafter = "no drafter" if not args.num_spec else "assistant" if assistant is not None else "MTP"
    print(f"== {name}: {mcfg.num_hidden_layers} layers, {getattr(mcfg, 'num_experts', 0)} experts, {args.dtype}, "
          f"batch {args.batch}, num_spec {args.num_spec} ({drafter}), context {context} ({device}) ==")
    print("bytes one step must move:")
    for k, v in sorted(nbytes.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<22} {v / 1e6:12.3f} MB")
    print(f"  {'total':<22} {total / 1e6:12.3f} MB")
    print(f"step time ({kind} replay, median of {args.reps}): verify {verify_ms:.3f} ms, "
          f"verify + proposal {step_ms:.3f} ms")
    result = dict(model=name, config=cfg, assistant_config=draft_cfg, batch=args.batch, num_spec=args.num_spec,
                  context=context, dtype=args.dtype, device=str(device), bytes=nbytes, total_bytes=total,
                  verify_ms=verify_ms, step_ms=step_ms, breakdown_ms=parts)
    if bw:
        bound_ms = total / (bw * 1e9) * 1e3
        verify_bytes = sum(v for k, v in nbytes.items() if not k.startswith(DRAFT_PREFIXES))
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
    if args.jsonl:
        with args.jsonl.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
