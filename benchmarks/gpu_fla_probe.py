"""Is fla-core's chunked GDN prefill usable here? (benchmarks/gpu_all.sh runs this first.)

mtpkit's Triton GDN prefill hands a prefill without state snapshots to fla-core's chunked
kernel whenever `fla` imports on CUDA (mtpkit/kernels/triton_gdn.py). That path has never run
on a GPU, and a crash there would fail every later part, so gpu_all.sh runs this probe and,
unless it prints PASS, exports MTPKIT_USE_FLA=0 (the recurrent Triton kernel) for the rest.

The probe: real Qwen3-Next GDN heads (16 key / 32 value heads of 128), varlen requests
(300, 0, 77 and 1 tokens; with and without initial state), fp32 and bf16: fla's output and
final states against the torch reference (mtpkit/kernels/gdn.py) and the recurrent Triton
kernel, relative to the reference's largest value.

    python benchmarks/gpu_fla_probe.py [--tol 2e-2]
"""

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tol", type=float, default=2e-2, help="max |diff| / max |reference|")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    import torch
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
        print(f"fla probe: SKIP, fla-core does not import ({type(e).__name__}: {e})")
        return 1
    from mtpkit.kernels import gdn as ref
    from mtpkit.kernels import triton_gdn as tg

    dev = args.device
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g).to(dtype).to(dev)
    hk, hv, dk, dv, lens = 16, 32, 128, 128, [300, 0, 77, 1]
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        T = sum(lens)
        mixed = r(T, 2 * hk * dk + hv * dv, dtype=dtype)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
        a, b = r(T, hv, dtype=dtype), r(T, hv, dtype=dtype)
        A_log = torch.log(torch.rand(hv, generator=g) * 4 + 0.5).to(dev)
        dt_bias = r(hv)
        pool = r(7, hv, dk, dv) * 0.1
        qsl = torch.tensor([0] + lens, device=dev).cumsum(0)
        read, write = torch.tensor([1, 3, 2, 5], device=dev), torch.tensor([2, 3, 4, 6], device=dev)
        has_init = torch.tensor([True, True, False, True], device=dev)
        outs = {}
        for name in ("reference", "fla", "recurrent"):
            p = pool.clone()
            fn = ref.gated_delta_rule_prefill if name == "reference" else tg.gated_delta_rule_prefill
            tg._FLA = name == "fla"   # the module's cached choice: fla or the recurrent kernel
            try:
                o = fn(q, k, v, a, b, A_log, dt_bias, p, qsl, read, write, has_init)
                if dev == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - whatever fla raises turns it off
                print(f"fla probe {dtype}: FAIL, {name} raised {type(e).__name__}: {e}")
                return 1
            outs[name] = (o.float(), p.float())
        tg._FLA = None
        o_ref, p_ref = outs["reference"]
        for name in ("fla", "recurrent"):
            o, p = outs[name]
            eo = ((o - o_ref).abs().max() / o_ref.abs().max()).item()
            es = ((p - p_ref).abs().max() / p_ref.abs().max()).item()
            good = eo <= args.tol and es <= args.tol and bool(torch.isfinite(o).all())
            ok &= good or name != "fla"
            print(f"fla probe {dtype} {name}: output {eo:.2e}, states {es:.2e} of the reference's max "
                  f"(tol {args.tol}) {'ok' if good else 'OFF'}")
    print("fla probe: PASS" if ok else "fla probe: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
