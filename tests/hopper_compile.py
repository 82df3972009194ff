"""Compile mtpkit's Triton kernels for a Hopper GPU (sm_90) on a machine without one (helper
of test_triton_compile.py, run as a script in a process without TRITON_INTERPRET).

The entry points are called at real layer shapes with two stand-ins: a kernel
"launch" records the kernel, its argument types, constexprs and num_warps instead of running,
and the entry points take the kernel path (not the torch reference) for any tensor. The data
tensors (activations, weights, caches, pools) are meta tensors: shape, strides and dtype
without storage, since a launch reads nothing else of them (real-size weights took 17 GB);
the index tensors whose values the entry points read (lengths, slots, expert ids) are small
real CPU tensors. A meta tensor's data_ptr() is its offset in bytes, so a launch is specialized
(16-byte alignment of pointers, ints divisible by 16, ints equal to 1) exactly as Triton's JIT
specializes the same launch of CUDA tensors, whose allocations are aligned. Every
decision they make about a launch (tiles, splits, 16-bit tensor-core products) is the one they
make on a GPU; the split count is computed for an H200's 132 multiprocessors. Each distinct
launch is then compiled with `triton.compile` for target cuda sm_90 with the signature,
constexprs and tt.divisibility attributes Triton's binder gives it, through Triton's own
ptxas, and its shared memory is compared with what one sm_90 block may use.

    python tests/hopper_compile.py      # prints one JSON object: {"launches": [...]}
"""

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from mtpkit.kernels import fp8_matmul, triton_conv, triton_fp8_matmul, triton_gdn, triton_paged  # noqa: E402
from mtpkit.kernels import triton_elementwise, triton_moe  # noqa: E402

SM90_SHARED = 227 * 1024  # the most shared memory one block may use on sm_90
H200_SMS = 132
TARGET = GPUTarget("cuda", 90, 32)  # a Hopper GPU: compute capability 9.0, warps of 32


def shaped(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A contiguous tensor of `shape` without storage: what a launch needs of a data tensor."""
    return torch.empty(shape, dtype=dtype, device="meta")


def record(calls) -> list[tuple]:
    """Run `calls` (thunks calling the entry points) with launches recorded: the distinct
    (kernel, signature, constexprs, attrs, options) they make, specialized as a GPU launch of
    the same arguments would be."""
    launches: dict[str, tuple] = {}

    backend = make_backend(TARGET)

    def fake_run(self, *args, grid, warmup, **kwargs):
        # Triton's own binder and packing, as JITFunction.run does on a GPU: pointers aligned to
        # 16 bytes and ints divisible by 16 get tt.divisibility 16, ints equal to 1 become constexprs.
        kwargs.update(debug=kwargs.get("debug", self.debug) or knobs.runtime.debug,
                      instrumentation_mode=knobs.compilation.instrumentation_mode,
                      fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
        bound, specialization, opts = create_function_from_signature(self.signature, self.params, backend)(
            *args, **kwargs)
        options, sig, const, attrs = self._pack_args(backend, kwargs, bound, specialization, opts)
        key = json.dumps([self.fn.__name__, sig, {str(k): repr(v) for k, v in const.items()},
                          {str(k): v for k, v in attrs.items()}, repr(options)], sort_keys=True)
        launches[key] = (self, sig, const, attrs, options)

    def kernel_path(module, *xs):  # what the entry points decide for CUDA tensors
        return any(x.dtype == torch.float64 for x in xs)

    saved = (JITFunction.run, triton_paged._sm_count)
    JITFunction.run = fake_run
    triton_paged._sm_count = lambda device: H200_SMS
    patched = [m for m in (triton_conv, triton_gdn, triton_paged, triton_fp8_matmul, triton_moe, triton_elementwise)
               if hasattr(m, "use_reference")]
    originals = [m.use_reference for m in patched]
    for m in patched:
        m.use_reference = kernel_path
    try:
        for call in calls:
            call()
    finally:
        JITFunction.run, triton_paged._sm_count = saved
        for m, orig in zip(patched, originals):
            m.use_reference = orig
    return list(launches.values())


def compile_sm90(fn: JITFunction, sig: dict, const: dict, attrs: dict, options) -> dict:
    kernel = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=TARGET,
                            options=options.__dict__)
    return dict(kernel=fn.fn.__name__, constexprs=named(fn, const), options=dict(num_warps=options.num_warps),
                shared=kernel.metadata.shared, cubin_bytes=len(kernel.asm["cubin"]),
                divisible_args=kernel.asm["ttir"].count("tt.divisibility = 16"))   # as compiled


def named(fn: JITFunction, const: dict) -> dict:
    """The constexprs by parameter name (Triton keys them by argument path)."""
    names = [p.name for p in fn.params]
    return {names[k[0]]: v for k, v in const.items() if v is not None}


# ---------------------------------------------------------------------------------------
# the entry points at real layer shapes (Qwen3-Next 80B-A3B; Gemma 4's head_dim 512)


def calls(dtype=torch.bfloat16, bundles=(1, 3, 4), prefill=True):
    hk, hv, dk, dv, C, W = 16, 32, 128, 128, 2 * 16 * 128 + 32 * 128, 4
    out = []
    for B in bundles:  # 1 and 3: both query-tile heights (BM 16 and 32)
        R = 2
        q, k = shaped(R, B, hk, dk, dtype=dtype), shaped(R, B, hk, dk, dtype=dtype)
        v, a = shaped(R, B, hv, dv, dtype=dtype), shaped(R, B, hv, dtype=dtype)
        pool = shaped(1 + R * B, hv, dk, dv)
        slots, acc = torch.zeros(R, B, dtype=torch.int64), torch.ones(R, dtype=torch.int64)
        out.append(lambda q=q, k=k, v=v, a=a, pool=pool, slots=slots, acc=acc: triton_gdn.gated_delta_rule_verify(
            q, k, v, a, a, shaped(hv), shaped(hv), pool, slots, acc))
        x, conv_pool = shaped(R, B, C, dtype=dtype), shaped(1 + R, C, W - 1 + B - 1, dtype=dtype)
        out.append(lambda x=x, conv_pool=conv_pool: triton_conv.causal_conv1d_verify(
            x, shaped(C, W, dtype=dtype), conv_pool, torch.zeros(R, dtype=torch.int64),
            torch.ones(R, dtype=torch.int64)))
        # ... and Gemma 4's: 31B sliding (32 heads, 16 KV, window 1024) and full (4 KV heads of
        # 512); 26B-A4B's full layers (16 heads, 2 KV of 512) are the second shape; no softcap.
        for H, KVH, D, ctx, window, cap in ((16, 2, 256, 4096, None, None), (16, 2, 512, 4096, None, None),
                                             (16, 8, 256, 1024, 512, 30.0), (32, 16, 256, 4096, 1024, None),
                                             (32, 4, 512, 4096, None, None)):
            nb = ctx // 16
            kc = shaped(1 + R * nb, 16, KVH, D, dtype=dtype)
            qa = shaped(R, B, H, D, dtype=dtype)
            out.append(lambda qa=qa, kc=kc, nb=nb, ctx=ctx, D=D, window=window, cap=cap:
                       triton_paged.paged_attention_verify(
                           qa, kc, kc, torch.full((R,), ctx, dtype=torch.int64),
                           torch.zeros(R, nb, dtype=torch.int64), D ** -0.5, window, cap, ctx))
    # The fused MoE at Qwen3-Next's expert shapes (512 experts of 512 x 2048, top 10): one
    # token, one bundle of 4, eight and 64 bundles of 4.
    E, I, Hd, K = 512, 512, 2048, 10
    w13, w_down = shaped(E, 2 * I, Hd, dtype=dtype), shaped(E, I, Hd, dtype=dtype)
    for T in (1, 4, 32, 256):   # 256: 64 bundles of 4, tiles of 64 tokens
        out.append(lambda T=T: triton_moe.moe_experts(
            shaped(T, Hd, dtype=dtype), w13, w_down, torch.arange(T * K).view(T, K) % E,
            shaped(T, K, dtype=dtype)))
    # Gemma 4 26B-A4B's experts (128 of 704 x 2816, top 8, gelu_tanh): a bundle of 4, 8 bundles.
    E, I, Hd, K = 128, 704, 2816, 8
    g13, g_down = shaped(E, 2 * I, Hd, dtype=dtype), shaped(E, I, Hd, dtype=dtype)
    for T in (4, 32):
        out.append(lambda T=T: triton_moe.moe_experts(
            shaped(T, Hd, dtype=dtype), g13, g_down, torch.arange(T * K).view(T, K) % E,
            shaped(T, K, dtype=dtype), "gelu_tanh"))
    out += glue_calls(dtype)
    if not prefill:
        return out
    out += fp8_calls(dtype)
    T, R = 64, 2
    qsl = torch.tensor([0, 32, 64])
    out.append(lambda: triton_gdn.gated_delta_rule_prefill(
        shaped(T, hk, dk, dtype=dtype), shaped(T, hk, dk, dtype=dtype), shaped(T, hv, dv, dtype=dtype),
        shaped(T, hv, dtype=dtype), shaped(T, hv, dtype=dtype), shaped(hv), shaped(hv),
        torch.zeros(1 + R, hv, dk, dv), qsl, torch.tensor([1, 2]), torch.tensor([1, 2]),   # real: its initial
        # states are gathered with the (CPU) slots; three states are 6 MB
        torch.zeros(R, dtype=torch.bool)))
    out.append(lambda: triton_conv.causal_conv1d_prefill(
        shaped(T, C, dtype=dtype), shaped(C, W, dtype=dtype), shaped(1 + R, C, W - 1 + 3, dtype=dtype),
        qsl, torch.tensor([1, 2]), torch.ones(R, dtype=torch.bool)))
    for D, q_len, H, KVH, window in ((256, 32, 16, 2, None), (256, 2048, 16, 2, None), (512, 32, 16, 2, None),
                                     (256, 2048, 32, 16, 1024), (512, 2048, 32, 4, None)):   # the last two: Gemma 4 31B
        kc = shaped(1 + 256, 16, KVH, D, dtype=dtype)
        out.append(lambda kc=kc, D=D, q_len=q_len, H=H, window=window: triton_paged.paged_attention_prefill(
            shaped(2 * q_len, H, D, dtype=dtype), kc, kc, torch.tensor([0, q_len, 2 * q_len]),
            torch.tensor([q_len, q_len]), torch.zeros(2, 128, dtype=torch.int64), D ** -0.5, window))
    return out


def glue_calls(dtype, tokens=(1, 32)):
    """The fused elementwise glue at real widths: residual norms over Qwen3-Next's hidden 2048
    and Gemma 4's 2816 (26B-A4B) and 5376 (31B); GDN's gated norm over 32 heads of 128; the
    gated activations of the shared expert (512), an attention output (16 x 256) and Gemma 4
    31B's MLP (21504, assumed). One token and 32 (8 requests x bundle 4)."""
    g = triton_elementwise
    out = []
    for T in tokens:
        for H in (2048, 2816, 5376):
            x, w, s = shaped(T, H, dtype=dtype), shaped(H, dtype=dtype), shaped(1, dtype=dtype)
            out += [lambda x=x, w=w: g.rms_norm(x, w, 1e-6, True),
                    lambda x=x, w=w: g.add_rms_norm(x, x, w, 1e-6, True),
                    lambda x=x, w=w: g.norm_add_rms_norm(x, x, w, w, 1e-6),
                    lambda x=x, w=w, s=s: g.norm_add(x, x, w, 1e-6, s),
                    lambda x=x, w=w: g.norm_add(x, x, w, 1e-6, None)]
        o, z = shaped(T, 32, 128, dtype=dtype), shaped(T, 64, 128, dtype=dtype)[:, :32]
        out.append(lambda o=o, z=z: g.gated_rms_norm(o, z, shaped(128, dtype=dtype), 1e-6))
        for N, act, row_gate in ((512, "silu", True), (4096, "sigmoid", False), (21504, "gelu_tanh", False)):
            h = shaped(T, 2 * N + 1, dtype=dtype)
            out.append(lambda h=h, N=N, act=act, rg=row_gate: g.act_mul(h[:, :N], h[:, N:2 * N], act,
                                                                          h[:, 2 * N:] if rg else None))
    return out


def fp8_calls(dtype):
    """The block-scaled FP8 matmul as Qwen3-Next-80B-FP8 and Gemma 4 use it: linear layers at
    decode (BM 16) and prefill (BM 64) sizes in the block layout (o_proj 4096 -> 2048, the merged
    qkv 2048 -> 9216 and GDN in_proj 2048 -> 12352) and with rows naming their scale rows (the
    shared expert's gate + up split 8 ways: 2 x 64 rows); the experts' batched products: each
    token-expert pair's expert gathered (Qwen3-Next's w13 [512, 1024, 2048] and down
    [512, 2048, 512], top 10 of 4 tokens; Gemma 4 26B-A4B's w13 [128, 1408, 2816], whose gate
    and up cut a block, so its rows name their scales) and every expert over shared rows
    (dense path: 32 tokens, fp32 output for the experts' sum)."""
    fp8, block, out = torch.float8_e4m3fn, (128, 128), []

    def linear(M, N, K, rows=None):
        xq, xs = fp8_matmul.quantize_activation(shaped(M, K), 128)
        wq, ws = shaped(N, K, dtype=fp8), shaped(-(-N // 128) + (rows is not None), -(-K // 128))
        return lambda: triton_fp8_matmul.fp8_block_matmul(xq, xs, wq, ws, block, dtype, rows)

    for M in (4, 2048):
        out += [linear(M, 2048, 4096), linear(M, 9216, 2048), linear(M, 12352, 2048)]
        out.append(linear(M, 128, 2048, torch.tensor([0] * 64 + [1] * 64, dtype=torch.int32)))

    def batched(B, M, E, N, K, experts=None, rows=None, out_dtype=dtype):
        xq, xs = fp8_matmul.quantize_activation(shaped(M, K), 128)
        xq, xs = xq[None].expand(B, M, K), xs[None].expand(B, M, xs.shape[1])
        wq = shaped(E, N, K, dtype=fp8)
        ws = shaped(E, -(-N // 128) + (rows is not None), -(-K // 128))
        return lambda: triton_fp8_matmul.fp8_batched_matmul(xq, xs, wq, ws, block, out_dtype, experts, rows)

    pairs = torch.arange(40) % 512
    out += [batched(40, 1, 512, 1024, 2048, pairs), batched(40, 1, 512, 2048, 512, pairs, out_dtype=torch.float32),
            batched(32, 1, 128, 1408, 2816, pairs % 128, (torch.arange(1408) // 128).to(torch.int32)),
            batched(8, 32, 8, 1024, 2048), batched(8, 32, 8, 2048, 512, out_dtype=torch.float32)]
    return out


def main() -> int:
    # 16-bit models use the tensor-core path; fp32 the IEEE fp32 products (larger tiles in shared memory)
    launches = record(calls(torch.bfloat16) + calls(torch.float32, bundles=(4,), prefill=False))
    results = []
    for fn, sig, const, attrs, options in launches:
        try:
            results.append(compile_sm90(fn, sig, const, attrs, options))
        except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
            results.append(dict(kernel=fn.fn.__name__, constexprs=named(fn, const),
                                options=dict(num_warps=options.num_warps), error=f"{type(e).__name__}: {str(e)[-2000:]}"))
    print(json.dumps({"launches": results, "sm90_shared": SM90_SHARED}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
