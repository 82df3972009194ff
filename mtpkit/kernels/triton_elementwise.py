"""Fused elementwise glue of the decoder layers (the "triton" backend's Ops.rms_norm ... act_mul):
one launch where the torch code runs several.

The torch references are elementwise.py (same signatures and semantics; tested against them
under TRITON_INTERPRET=1). At decode sizes every op in a CUDA graph costs a launch of a few
microseconds whatever it moves, and an unfused RMSNorm in bf16 is half a dozen of them (cast,
square, mean, rsqrt, two products, cast back) plus the residual add before it. Here:

- `_residual_norm_kernel`, one program per row (the whole hidden row in registers): an
  optional RMSNorm of the input (Gemma's sandwich norm), the residual add, an optional scalar
  (Gemma's layer_scalar), the sum stored, then the RMSNorm of the sum (zero-centred 1 + w,
  or plain w). Entry points rms_norm, add_rms_norm, norm_add_rms_norm, norm_add.
- `_gated_rms_norm_kernel`: GDN's rmsnorm(x) * w * silu(z), BM head rows per program.
- `_act_mul_kernel`: act(g) * u [* sigmoid(row gate)] over strided views of one projection.

Arithmetic in fp32 with the references' roundings: every value the torch code rounds to the
activation dtype (a residual sum, a normed value before its weight in the gated norm, an
activation before its product) is rounded here too, so 16-bit results differ from the
reference only where fp32 sums or exp differ in the last bits.
triton_common.use_reference's rule (fp64) sends a call to the torch reference.
"""

import torch
import triton
import triton.language as tl

from mtpkit.kernels.triton_common import use_reference
from mtpkit.shapes import Float, Tensor, checked
from mtpkit.kernels import elementwise as ref

__all__ = ["rms_norm", "add_rms_norm", "norm_add_rms_norm", "norm_add", "gated_rms_norm", "act_mul"]

@triton.jit
def _rounded(y, DT: tl.constexpr):
    """y rounded to the activation dtype, back in fp32 (no op for fp32)."""
    return y.to(DT).to(tl.float32)


@triton.jit
def _inv_rms(h, N, eps, axis: tl.constexpr):
    return tl.rsqrt(tl.sum(h * h, axis=axis) / N + eps)


@triton.jit
def _residual_norm_kernel(x, res, x_w, w, scalar, normed, summed, N, sx, sr, sn, ss, eps,
                          PRE_NORM: tl.constexpr, HAS_RES: tl.constexpr, SCALAR: tl.constexpr,
                          STORE_SUM: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                          BLOCK: tl.constexpr):
    DT: tl.constexpr = x.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    h = tl.load(x + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    if PRE_NORM:   # norm(x) * x_w, rounded as the norm's output is before the add
        xw = tl.load(x_w + cols, mask=m, other=0.0).to(tl.float32)
        h = _rounded(h * _inv_rms(h, N, eps, 0) * xw, DT)
    if HAS_RES:
        h = _rounded(tl.load(res + row * sr + cols, mask=m, other=0.0).to(tl.float32) + h, DT)
    if SCALAR:
        h = _rounded(h * tl.load(scalar).to(tl.float32), DT)
    if STORE_SUM:
        tl.store(summed + row * ss + cols, h.to(DT), mask=m)
    if NORM:
        scale = tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            scale = scale + 1.0
        tl.store(normed + row * sn + cols, (h * _inv_rms(h, N, eps, 0) * scale).to(DT), mask=m)


def _residual_norm(x, res, x_w, w, scalar, eps, zero_centred, store_sum):
    T, N = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    res = None if res is None else (res if res.stride(-1) == 1 else res.contiguous())
    normed = torch.empty_like(x, memory_format=torch.contiguous_format) if w is not None else None
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if store_sum else None
    dummy = x  # stands in for the pointers a variant does not read or write (never dereferenced)
    BLOCK = triton.next_power_of_2(N)
    _residual_norm_kernel[(T,)](
        x, dummy if res is None else res, dummy if x_w is None else x_w, dummy if w is None else w,
        dummy if scalar is None else scalar, dummy if normed is None else normed,
        dummy if summed is None else summed, N, x.stride(0), 0 if res is None else res.stride(0),
        N, N, eps, PRE_NORM=x_w is not None, HAS_RES=res is not None, SCALAR=scalar is not None,
        STORE_SUM=store_sum, NORM=w is not None, ZERO_CENTRED=zero_centred, BLOCK=BLOCK,
        num_warps=min(16, max(1, BLOCK // 512)))
    return normed, summed


@checked
def rms_norm(x: Float[Tensor, "num_tokens hidden"], weight: Float[Tensor, "hidden"], eps: float,
             zero_centred: bool) -> Float[Tensor, "num_tokens hidden"]:
    if use_reference(__name__, x, weight):
        return ref.rms_norm(x, weight, eps, zero_centred)
    return _residual_norm(x, None, None, weight, None, eps, zero_centred, False)[0]


@checked
def add_rms_norm(x: Float[Tensor, "num_tokens hidden"], residual: Float[Tensor, "num_tokens hidden"],
                 weight: Float[Tensor, "hidden"], eps: float, zero_centred: bool
                 ) -> tuple[Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens hidden"]]:
    if use_reference(__name__, x, residual, weight):
        return ref.add_rms_norm(x, residual, weight, eps, zero_centred)
    return _residual_norm(x, residual, None, weight, None, eps, zero_centred, True)


@checked
def norm_add_rms_norm(x: Float[Tensor, "num_tokens hidden"], residual: Float[Tensor, "num_tokens hidden"],
                      x_weight: Float[Tensor, "hidden"], weight: Float[Tensor, "hidden"], eps: float
                      ) -> tuple[Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens hidden"]]:
    if use_reference(__name__, x, residual, weight):
        return ref.norm_add_rms_norm(x, residual, x_weight, weight, eps)
    return _residual_norm(x, residual, x_weight, weight, None, eps, False, True)


@checked
def norm_add(x: Float[Tensor, "num_tokens hidden"], residual: Float[Tensor, "num_tokens hidden"],
             x_weight: Float[Tensor, "hidden"], eps: float, scalar: Float[Tensor, "1"] | None
             ) -> Float[Tensor, "num_tokens hidden"]:
    if use_reference(__name__, x, residual, x_weight):
        return ref.norm_add(x, residual, x_weight, eps, scalar)
    return _residual_norm(x, residual, x_weight, None, scalar, eps, False, True)[1]


@triton.jit
def _gated_rms_norm_kernel(x, z, w, out, M, D, heads, sxt, sxh, szt, szh, eps, BM: tl.constexpr, BD: tl.constexpr):
    DT: tl.constexpr = x.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    t, hh = rows // heads, rows % heads
    cols = tl.arange(0, BD)
    m = (rows < M)[:, None] & (cols < D)[None, :]
    xv = tl.load(x + (t * sxt + hh * sxh)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    zv = tl.load(z + (t * szt + hh * szh)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    wv = tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32)
    # 16-bit: norm(x) rounded before the weight, w * norm rounded, then the fp32 product with silu(z).
    y = _rounded(wv[None, :] * _rounded(xv * _inv_rms(xv, D, eps, 1)[:, None], DT), DT)
    tl.store(out + rows[:, None] * D + cols[None, :], (y * (zv * tl.sigmoid(zv))).to(DT), mask=m)


@checked
def gated_rms_norm(x: Float[Tensor, "num_tokens v_heads v_dim"], z: Float[Tensor, "num_tokens v_heads v_dim"],
                   weight: Float[Tensor, "v_dim"], eps: float) -> Float[Tensor, "num_tokens v_heads v_dim"]:
    if use_reference(__name__, x, z, weight):
        return ref.gated_rms_norm(x, z, weight, eps)
    T, HV, D = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    z = z if z.stride(-1) == 1 else z.contiguous()
    out = torch.empty(T, HV, D, dtype=x.dtype, device=x.device)
    BD = triton.next_power_of_2(D)
    BM = max(1, min(16, 4096 // BD))
    M = T * HV
    _gated_rms_norm_kernel[(triton.cdiv(M, BM),)](x, z, weight, out, M, D, HV, x.stride(0), x.stride(1),
                                                  z.stride(0), z.stride(1), eps, BM=BM, BD=BD, num_warps=4)
    return out


ACTS = {"silu": 0, "gelu_tanh": 1, "sigmoid": 2}   # elementwise.ACTIVATIONS by number


@triton.jit
def activation(x, ACT: tl.constexpr):
    """ACTS[name] of fp32 x (the fused MoE's experts use it too)."""
    if ACT == 0:
        a = x * tl.sigmoid(x)
    elif ACT == 1:   # gelu, tanh approximation: 0.5 x (1 + tanh(y)) = x sigmoid(2y), no cancellation near -1
        y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        a = x * tl.sigmoid(2.0 * y)
    else:
        a = tl.sigmoid(x)
    return a


@triton.jit
def _act_mul_kernel(g, u, rg, out, N, sg, su, sr, ACT: tl.constexpr, ROW_GATE: tl.constexpr, BN: tl.constexpr):
    DT: tl.constexpr = g.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    m = cols < N
    gv = tl.load(g + row * sg + cols, mask=m, other=0.0).to(tl.float32)
    uv = tl.load(u + row * su + cols, mask=m, other=0.0).to(tl.float32)
    a = activation(gv, ACT)
    o = _rounded(_rounded(a, DT) * uv, DT)
    if ROW_GATE:
        o = o * _rounded(tl.sigmoid(tl.load(rg + row * sr).to(tl.float32)), DT)
    tl.store(out + row * N + cols, o.to(DT), mask=m)


@checked
def act_mul(g: Float[Tensor, "num_tokens gated_dim"], u: Float[Tensor, "num_tokens gated_dim"], act: str,
            row_gate: Float[Tensor, "num_tokens 1"] | None = None) -> Float[Tensor, "num_tokens gated_dim"]:
    if use_reference(__name__, g, u):
        return ref.act_mul(g, u, act, row_gate)
    T, N = g.shape
    g = g if g.stride(-1) == 1 else g.contiguous()
    u = u if u.stride(-1) == 1 else u.contiguous()
    out = torch.empty(T, N, dtype=g.dtype, device=g.device)
    BN = min(1024, triton.next_power_of_2(N))
    _act_mul_kernel[(T, triton.cdiv(N, BN))](
        g, u, g if row_gate is None else row_gate, out, N, g.stride(0), u.stride(0),
        0 if row_gate is None else row_gate.stride(0), ACT=ACTS[act], ROW_GATE=row_gate is not None, BN=BN,
        num_warps=4)
    return out
