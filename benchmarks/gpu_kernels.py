"""GPU check of mtpkit's Triton attention-side kernels (needs CUDA).

1. Runs tests/test_triton_kernels.py natively on the GPU (MTPKIT_TRITON_TEST_DEVICE=cuda,
   no interpreter): every kernel against its torch reference, as on CPU (--no-tests skips).
2. Measures the device copy bandwidth (a 1 GiB device-to-device copy: bytes read + written
   over time) and times every kernel against its torch reference at real Qwen3-Next layer
   shapes (GDN: 16 key / 32 value heads of 128, conv_dim 8192, conv width 4; attention:
   16 heads / 2 KV heads of 256, pages of 16) for batch 1, 8, 64 and bundle 3, 4, plus a
   head_dim-512 attention layer (Gemma 4 full-attention size) and three prefill shapes; and
   the fused elementwise glue (kernels/triton_elementwise.py) against its torch reference, the
   unfused ops the torch backend runs, for 4 and 32 tokens (batch 1 and 8, bundle 4):
   Qwen3-Next's residual add + norm (hidden 2048), GDN gated norm (32 x 128), shared-expert
   and attention-gate activations; Gemma 4's sandwich norms (26B-A4B 2816, 31B 5376) and
   31B's gelu-tanh MLP activation (21504). These are timed as CUDA-graph replays (both sides),
   as the step's graph runs them, so the torch side's host dispatch is not counted; the kernels
   above are timed eagerly.

Table: kernel, shape, Triton ms, torch ms, their ratio (torch / Triton: > 1 is Triton faster),
bytes moved (the minimum the op must read and write), bound ms (bytes / copy bandwidth),
% of bound (bound / Triton time), and the max |Triton - torch| over outputs (and the state
pools written). Times are medians of CUDA-event
timings with the L2 cache flushed before every run.

    python benchmarks/gpu_kernels.py [--no-tests] [--ctx 4096] [--batches 1 8 64]
                                     [--bundles 3 4] [--json results.json]
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Qwen3-Next (80B-A3B) layer shapes
GDN = dict(hk=16, hv=32, dk=128, dv=128)
CONV = dict(C=2 * 16 * 128 + 32 * 128, W=4)
ATTN = dict(H=16, KVH=2, D=256, page=16)
ATTN_512 = dict(H=16, KVH=2, D=512, page=16)
DEV = "cuda"  # the case builders' device (a CPU dry run under TRITON_INTERPRET sets "cpu")


def run_tests() -> bool:
    if importlib.util.find_spec("pytest") is None:
        print("[tests] pytest is not installed: skipping the kernel tests (pip install pytest)")
        return True
    env = dict(os.environ, MTPKIT_TRITON_TEST_DEVICE="cuda", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_kernels.py",
           "tests/test_triton_elementwise.py"]
    if importlib.util.find_spec("xdist") is not None:  # compiling ~150 kernel variants: in parallel
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    print("[tests] " + " ".join(cmd[2:]) + "  (MTPKIT_TRITON_TEST_DEVICE=cuda)", flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    print(f"[tests] {'passed' if rc == 0 else f'FAILED (exit {rc})'}", flush=True)
    return rc == 0


# ---------------------------------------------------------------------------------------
# timing


def bench(fn, rep_ms: float = 60.0, max_reps: int = 200) -> float:
    """Median ms of fn() over CUDA events, L2 flushed (a 256 MiB write) before each run."""
    import torch

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 3, 1e-3)
    n = int(max(5, min(max_reps, rep_ms / est)))
    for _ in range(min(n, 10)):  # warm-up
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    import torch

    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep_ms=200)
    return 2 * n / (ms * 1e-3)


def maxdiff(pairs) -> float:
    return max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in pairs)


# ---------------------------------------------------------------------------------------
# cases: each returns (label, shape, triton_fn, torch_fn, bytes, diff)


def gdn_verify_case(R: int, B: int):
    import torch
    from mtpkit.kernels import gdn, triton_gdn

    hk, hv, dk, dv = GDN["hk"], GDN["hv"], GDN["dk"], GDN["dv"]
    dev, bf = DEV, torch.bfloat16
    mixed = torch.randn(R, B, 2 * hk * dk + hv * dv, device=dev, dtype=bf)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    a, b = torch.randn(R, B, hv, device=dev, dtype=bf), torch.randn(R, B, hv, device=dev, dtype=bf)
    A_log = torch.log(torch.rand(hv, device=dev) * 4 + 0.5)
    dt_bias = torch.randn(hv, device=dev)
    pool = torch.randn(1 + R * B, hv, dk, dv, device=dev) * 0.1
    slots = (torch.randperm(R * B, device=dev) + 1).view(R, B)
    acc = torch.randint(1, B + 1, (R,), device=dev)
    args = lambda p: (q, k, v, a, b, A_log, dt_bias, p, slots, acc)  # noqa: E731
    p_t, p_r = pool.clone(), pool.clone()
    o_t = triton_gdn.gated_delta_rule_verify(*args(p_t))
    o_r = gdn.gated_delta_rule_verify(*args(p_r))
    diff = maxdiff([(o_t, o_r), (p_t, p_r)])
    state = hv * dk * dv * 4
    nbytes = R * state * (1 + B) + mixed.numel() * 2 + 2 * a.numel() * 2 + o_t.numel() * 2
    return ("gdn_verify", f"R={R} B={B}", lambda: triton_gdn.gated_delta_rule_verify(*args(p_t)),
            lambda: gdn.gated_delta_rule_verify(*args(p_r)), nbytes, diff)


def conv_verify_case(R: int, B: int):
    import torch
    from mtpkit.kernels import conv, triton_conv

    C, W = CONV["C"], CONV["W"]
    L = W - 1 + B - 1
    dev, bf = DEV, torch.bfloat16
    x = torch.randn(R, B, C, device=dev, dtype=bf)
    weight = torch.randn(C, W, device=dev, dtype=bf)
    pool = torch.randn(1 + R, C, L, device=dev, dtype=bf)
    slots = torch.randperm(R, device=dev) + 1
    acc = torch.randint(1, B + 1, (R,), device=dev)
    p_t, p_r = pool.clone(), pool.clone()
    o_t = triton_conv.causal_conv1d_verify(x, weight, p_t, slots, acc)
    o_r = conv.causal_conv1d_verify(x, weight, p_r, slots, acc)
    diff = maxdiff([(o_t, o_r), (p_t, p_r)])
    nbytes = 2 * (R * C * (W - 1) + x.numel() + weight.numel() + R * C * L + o_t.numel())
    return ("conv_verify", f"R={R} B={B}", lambda: triton_conv.causal_conv1d_verify(x, weight, p_t, slots, acc),
            lambda: conv.causal_conv1d_verify(x, weight, p_r, slots, acc), nbytes, diff)


def _kv(R, ctx, shape, dev, dtype):
    import torch

    page, KVH, D = shape["page"], shape["KVH"], shape["D"]
    nb = -(-ctx // page)
    num_blocks = 1 + R * nb
    k_cache = torch.randn(num_blocks, page, KVH, D, device=dev, dtype=dtype)
    v_cache = torch.randn(num_blocks, page, KVH, D, device=dev, dtype=dtype)
    table = (torch.randperm(R * nb, device=dev) + 1).view(R, nb)
    return k_cache, v_cache, table


def paged_verify_case(R: int, B: int, ctx: int, shape=ATTN, label="paged_verify"):
    import torch
    from mtpkit.kernels import paged, triton_paged

    H, KVH, D = shape["H"], shape["KVH"], shape["D"]
    dev, bf = DEV, torch.bfloat16
    k_cache, v_cache, table = _kv(R, ctx, shape, dev, bf)
    seq_lens = torch.full((R,), ctx, device=dev, dtype=torch.int64)
    q = torch.randn(R, B, H, D, device=dev, dtype=bf)
    args = (q, k_cache, v_cache, seq_lens, table, D ** -0.5, None, None, ctx)
    o_t = triton_paged.paged_attention_verify(*args)
    o_r = paged.paged_attention_verify(*args)
    nbytes = 2 * (2 * R * ctx * KVH * D + 2 * q.numel()) + table.numel() * 8
    splits = triton_paged.num_splits(R, KVH, ctx, q.device)
    return (label, f"R={R} B={B} ctx={ctx} D={D} splits={splits}",
            lambda: triton_paged.paged_attention_verify(*args), lambda: paged.paged_attention_verify(*args),
            nbytes, maxdiff([(o_t, o_r)]))


def gdn_prefill_case(lens):
    import torch
    from mtpkit.kernels import gdn, triton_gdn

    hk, hv, dk, dv = GDN["hk"], GDN["hv"], GDN["dk"], GDN["dv"]
    dev, bf = DEV, torch.bfloat16
    T, R = sum(lens), len(lens)
    q = torch.randn(T, hk, dk, device=dev, dtype=bf)
    k = torch.randn(T, hk, dk, device=dev, dtype=bf)
    v = torch.randn(T, hv, dv, device=dev, dtype=bf)
    a, b = torch.randn(T, hv, device=dev, dtype=bf), torch.randn(T, hv, device=dev, dtype=bf)
    A_log = torch.log(torch.rand(hv, device=dev) * 4 + 0.5)
    dt_bias = torch.randn(hv, device=dev)
    pool = torch.zeros(1 + R, hv, dk, dv, device=dev)
    qsl = torch.tensor([0] + list(lens), device=dev).cumsum(0)
    slots = torch.arange(1, R + 1, device=dev)
    no_init = torch.zeros(R, dtype=torch.bool, device=dev)
    args = lambda p: (q, k, v, a, b, A_log, dt_bias, p, qsl, slots, slots, no_init)  # noqa: E731
    p_t, p_r = pool.clone(), pool.clone()
    o_t = triton_gdn.gated_delta_rule_prefill(*args(p_t))
    o_r = gdn.gated_delta_rule_prefill(*args(p_r))
    path = "fla" if triton_gdn.fla_available() else "triton-recurrent"
    nbytes = 2 * (q.numel() + k.numel() + 2 * v.numel() + 2 * a.numel()) + R * hv * dk * dv * 4
    return (f"gdn_prefill[{path}]", f"lens={list(lens)}", lambda: triton_gdn.gated_delta_rule_prefill(*args(p_t)),
            lambda: gdn.gated_delta_rule_prefill(*args(p_r)), nbytes, maxdiff([(o_t, o_r), (p_t, p_r)]))


def conv_prefill_case(lens):
    import torch
    from mtpkit.kernels import conv, triton_conv

    C, W = CONV["C"], CONV["W"]
    L = W - 1 + 3
    dev, bf = DEV, torch.bfloat16
    T, R = sum(lens), len(lens)
    x = torch.randn(T, C, device=dev, dtype=bf)
    weight = torch.randn(C, W, device=dev, dtype=bf)
    pool = torch.randn(1 + R, C, L, device=dev, dtype=bf)
    qsl = torch.tensor([0] + list(lens), device=dev).cumsum(0)
    slots = torch.arange(1, R + 1, device=dev)
    init = torch.ones(R, dtype=torch.bool, device=dev)
    p_t, p_r = pool.clone(), pool.clone()
    o_t = triton_conv.causal_conv1d_prefill(x, weight, p_t, qsl, slots, init)
    o_r = conv.causal_conv1d_prefill(x, weight, p_r, qsl, slots, init)
    nbytes = 2 * (2 * x.numel() + weight.numel() + 2 * R * C * L)
    return ("conv_prefill", f"lens={list(lens)}",
            lambda: triton_conv.causal_conv1d_prefill(x, weight, p_t, qsl, slots, init),
            lambda: conv.causal_conv1d_prefill(x, weight, p_r, qsl, slots, init),
            nbytes, maxdiff([(o_t, o_r), (p_t, p_r)]))


def paged_prefill_case(q_lens, prefix: int):
    import torch
    from mtpkit.kernels import paged, triton_paged

    H, KVH, D = ATTN["H"], ATTN["KVH"], ATTN["D"]
    dev, bf = DEV, torch.bfloat16
    R = len(q_lens)
    ctx = prefix + max(q_lens)
    k_cache, v_cache, table = _kv(R, ctx, ATTN, dev, bf)
    seq_lens = torch.tensor([prefix + n for n in q_lens], device=dev)
    q = torch.randn(sum(q_lens), H, D, device=dev, dtype=bf)
    qsl = torch.tensor([0] + list(q_lens), device=dev).cumsum(0)
    args = (q, k_cache, v_cache, qsl, seq_lens, table, D ** -0.5)
    o_t = triton_paged.paged_attention_prefill(*args)
    o_r = paged.paged_attention_prefill(*args)
    nbytes = 2 * (2 * int(seq_lens.sum()) * KVH * D + 2 * q.numel())
    return ("paged_prefill", f"q_lens={list(q_lens)} prefix={prefix}",
            lambda: triton_paged.paged_attention_prefill(*args), lambda: paged.paged_attention_prefill(*args),
            nbytes, maxdiff([(o_t, o_r)]))


def glue_case(kind: str, T: int):
    """One fused glue op at a real width, against elementwise.py's unfused torch ops."""
    import torch
    from mtpkit.kernels import elementwise as ref
    from mtpkit.kernels import triton_elementwise as fused

    dev, bf = DEV, torch.bfloat16

    def rows(n):
        return torch.randn(T, n, device=dev, dtype=bf)

    def weight(n, centre):
        return (torch.randn(n, device=dev) * 0.1 + centre).to(bf)

    if kind.startswith("add_rms_norm"):           # Qwen3-Next: residual add + zero-centred norm
        H = int(kind.split("_")[-1])
        name, args, nbytes = "add_rms_norm", (rows(H), rows(H), weight(H, 0.0), 1e-6, True), 2 * (4 * T * H + H)
    elif kind.startswith("norm_add_rms_norm"):    # Gemma 4: post-attention norm, add, pre-FFN norm
        H = int(kind.split("_")[-1])
        name, args = "norm_add_rms_norm", (rows(H), rows(H), weight(H, 1.0), weight(H, 1.0), 1e-6)
        nbytes = 2 * (4 * T * H + 2 * H)
    elif kind.startswith("norm_add_scalar"):      # Gemma 4: post-FFN norm, add, layer_scalar
        H = int(kind.split("_")[-1])
        name, args = "norm_add", (rows(H), rows(H), weight(H, 1.0), 1e-6, torch.full((1,), 0.7, device=dev, dtype=bf))
        nbytes = 2 * (3 * T * H + H)
    elif kind == "gated_rms_norm":                # Qwen3-Next GDN output: 32 heads of 128, z a view
        z = torch.randn(T, 64, 128, device=dev, dtype=bf)[:, 32:]
        name, args = "gated_rms_norm", (torch.randn(T, 32, 128, device=dev, dtype=bf), z, weight(128, 1.0), 1e-6)
        nbytes = 2 * (3 * T * 4096 + 128)
    else:                                         # act_mul over a merged projection's views
        act, N, row_gate = {"shared_expert": ("silu", 512, True), "attn_gate": ("sigmoid", 4096, False),
                            "gelu_mlp": ("gelu_tanh", 21504, False)}[kind]
        h = rows(2 * N + 1)
        name, args = "act_mul", (h[:, :N], h[:, N:2 * N], act, h[:, 2 * N:] if row_gate else None)
        nbytes = 2 * (3 * T * N + (T if row_gate else 0))
    fn_t, fn_r = getattr(fused, name), getattr(ref, name)
    out_t, out_r = fn_t(*args), fn_r(*args)
    pairs = list(zip(out_t, out_r)) if isinstance(out_t, tuple) else [(out_t, out_r)]
    # Both sides timed as CUDA-graph replays, as the step runs them: the unfused ops' host
    # dispatch is then not part of the ratio, their extra launches and memory passes are.
    return (f"glue:{kind}", f"T={T}", graphed(lambda: fn_t(*args)), graphed(lambda: fn_r(*args)), nbytes,
            maxdiff(pairs))


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up run on a side stream): its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


GLUE_KINDS = ("add_rms_norm_2048", "gated_rms_norm", "shared_expert", "attn_gate", "norm_add_rms_norm_2816",
              "norm_add_rms_norm_5376", "norm_add_scalar_5376", "gelu_mlp")


# ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-tests", action="store_true", help="skip the kernel tests on CUDA")
    ap.add_argument("--ctx", type=int, default=4096, help="context length of the verify attention rows")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--bundles", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--json", type=str, default=None, help="also write the rows to this file")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("benchmarks/gpu_kernels.py needs torch (with CUDA)")
        return 2
    if not torch.cuda.is_available():
        print("benchmarks/gpu_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False here. "
              "The same kernel tests run on CPU under the Triton interpreter: "
              "python -m pytest tests/test_triton_kernels.py")
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    try:
        import mtpkit.kernels.triton_ops  # noqa: F401
    except ImportError as e:
        print(f"cannot import mtpkit's Triton backend ({e}); install the project's dependencies "
              "(pip install -e . : jaxtyping, beartype, triton)")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    import triton
    print(f"triton {triton.__version__}", flush=True)

    ok = True
    if not args.no_tests:
        ok = run_tests()

    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"\ncopy bandwidth: {bw / 1e9:.0f} GB/s (read + write of a 1 GiB device copy)\n", flush=True)

    cases = []
    for R in args.batches:
        for B in args.bundles:
            cases += [lambda R=R, B=B: gdn_verify_case(R, B),
                      lambda R=R, B=B: conv_verify_case(R, B),
                      lambda R=R, B=B: paged_verify_case(R, B, args.ctx),
                      lambda R=R, B=B: paged_verify_case(R, B, args.ctx, ATTN_512, "paged_verify_hd512")]
    for T in (4, 32):   # batch 1 and 8, bundle 4
        cases += [lambda kind=kind, T=T: glue_case(kind, T) for kind in GLUE_KINDS]
    cases += [lambda: gdn_prefill_case([2048]), lambda: gdn_prefill_case([512] * 8),
              lambda: conv_prefill_case([2048]), lambda: conv_prefill_case([512] * 8),
              lambda: paged_prefill_case([2048], 0), lambda: paged_prefill_case([512] * 4, 1536)]

    head = (f"{'kernel':<26} {'shape':<40} {'triton ms':>10} {'torch ms':>10} {'torch/tri':>9} {'MB':>9} "
            f"{'bound ms':>9} {'% bound':>8} {'max|diff|':>10}")
    print(head)
    print("-" * len(head), flush=True)
    rows = []
    for make in cases:
        try:
            label, shape, fn_t, fn_r, nbytes, diff = make()
            t_ms = bench(fn_t)
            r_ms = bench(fn_r, rep_ms=30, max_reps=20)
        except Exception as e:  # report and go on: one failing shape should not hide the rest
            print(f"FAILED {make}: {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        finally:
            torch.cuda.empty_cache()
        bound = nbytes / bw * 1e3
        row = dict(kernel=label, shape=shape, triton_ms=t_ms, torch_ms=r_ms, torch_over_triton=r_ms / t_ms,
                   bytes=nbytes, bound_ms=bound, pct_of_bound=100 * bound / t_ms, max_abs_diff=diff)
        rows.append(row)
        print(f"{label:<26} {shape:<40} {t_ms:>10.4f} {r_ms:>10.3f} {r_ms / t_ms:>9.2f} {nbytes / 1e6:>9.2f} "
              f"{bound:>9.4f} {row['pct_of_bound']:>7.1f}% {diff:>10.2e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_bandwidth=bw, rows=rows, tests_ok=ok), indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
