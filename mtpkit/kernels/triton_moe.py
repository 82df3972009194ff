"""Fused MoE experts for decode and verify steps (the "triton" backend's Ops.moe_experts): two
launches, each touched expert read once.

The torch reference is moe_experts.py (same name, signature and semantics; tested against it
under TRITON_INTERPRET=1). A step's T tokens choose K experts each. The T*K token-expert pairs are
sorted by expert on the device (fixed shapes, no host sync, so the call can be captured); the
pairs of one expert are then contiguous, and the first pair of each run is its leader.

Gate/up (`_moe_gate_up_kernel`), grid (T*K, cdiv(I, BI)): a leader program loads BI rows of its
expert's gate and up weights once per hidden chunk and multiplies them with the hidden states of
every token of its run (BT at a time), storing act(gate) * up * routing weight per pair (act:
silu, or Gemma 4's gelu_tanh). Other programs do nothing.
Down (`_moe_down_kernel`), grid (T*K, cdiv(H, BH)): a leader multiplies its run's activations
with BH columns of its expert's down block, storing one [H] row per pair; the K rows of a token
are summed afterwards. So the bytes read are the touched experts once, not once per token.

Math in fp32 (tensor-core products for 16-bit weights, IEEE fp32 products for fp32 weights);
triton_common.use_reference's rule (fp64) sends a call to the torch reference.
"""

import torch
import triton
import triton.language as tl

from mtpkit.kernels.triton_common import interpreting, use_reference
from mtpkit.shapes import Float, Int, Tensor, checked
from mtpkit.kernels import moe_experts as ref
from mtpkit.kernels.triton_elementwise import ACTS, activation

__all__ = ["moe_experts"]


@triton.jit
def _leader_run(sorted_e, counts, p):
    """(expert, pairs in its run) for pair p: the run's length if p leads it, else 0."""
    e = tl.load(sorted_e + p)
    prev = tl.load(sorted_e + tl.maximum(p - 1, 0))
    lead = (p == 0) | (prev != e)
    return e, tl.where(lead, tl.load(counts + e), 0)


@triton.jit
def _moe_gate_up_kernel(x, w13, order, sorted_e, counts, weights, pair_act, H, I, K,
                        sx, sxh, swe, swr, swh, BT: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr,
                        NATIVE: tl.constexpr, ACT: tl.constexpr):
    p = tl.program_id(0)
    i0 = tl.program_id(1) * BI
    e, n = _leader_run(sorted_e, counts, p)
    ri = i0 + tl.arange(0, BI)
    imask = ri < I
    wbase = w13 + e.to(tl.int64) * swe
    for j0 in range(0, n, BT):
        rj = j0 + tl.arange(0, BT)
        jmask = rj < n
        pair = tl.load(order + p + rj, mask=jmask, other=0)
        tok = pair // K
        acc_g = tl.zeros((BT, BI), dtype=tl.float32)
        acc_u = tl.zeros((BT, BI), dtype=tl.float32)
        for h0 in range(0, H, BH):
            rh = h0 + tl.arange(0, BH)
            hmask = rh < H
            xs = tl.load(x + tok[:, None].to(tl.int64) * sx + rh[None, :] * sxh, mask=jmask[:, None] & hmask[None, :], other=0.0)
            wmask = imask[:, None] & hmask[None, :]
            wg = tl.load(wbase + ri[:, None] * swr + rh[None, :] * swh, mask=wmask, other=0.0)
            wu = tl.load(wbase + (I + ri[:, None]) * swr + rh[None, :] * swh, mask=wmask, other=0.0)
            if NATIVE:
                acc_g += tl.dot(xs, tl.trans(wg))
                acc_u += tl.dot(xs, tl.trans(wu))
            else:
                acc_g += tl.dot(xs.to(tl.float32), tl.trans(wg.to(tl.float32)), input_precision="ieee")
                acc_u += tl.dot(xs.to(tl.float32), tl.trans(wu.to(tl.float32)), input_precision="ieee")
        rw = tl.load(weights + pair, mask=jmask, other=0.0).to(tl.float32)
        a = activation(acc_g, ACT) * acc_u * rw[:, None]
        tl.store(pair_act + (p + rj)[:, None].to(tl.int64) * I + ri[None, :], a, mask=jmask[:, None] & imask[None, :])


@triton.jit
def _moe_down_kernel(pair_act, w_down, order, sorted_e, counts, out, H, I,
                     swe, swi, swh, BT: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr, DOT16: tl.constexpr,
                     NATIVE: tl.constexpr):
    p = tl.program_id(0)
    h0 = tl.program_id(1) * BH
    e, n = _leader_run(sorted_e, counts, p)
    rh = h0 + tl.arange(0, BH)
    hmask = rh < H
    wbase = w_down + e.to(tl.int64) * swe
    for j0 in range(0, n, BT):
        rj = j0 + tl.arange(0, BT)
        jmask = rj < n
        pair = tl.load(order + p + rj, mask=jmask, other=0)
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for i0 in range(0, I, BI):
            ri = i0 + tl.arange(0, BI)
            imask = ri < I
            a = tl.load(pair_act + (p + rj)[:, None].to(tl.int64) * I + ri[None, :], mask=jmask[:, None] & imask[None, :],
                        other=0.0)
            w = tl.load(wbase + ri[:, None] * swi + rh[None, :] * swh, mask=imask[:, None] & hmask[None, :], other=0.0)
            if DOT16:  # the activations rounded to the weights' 16-bit type, as a 16-bit GEMM does
                a = a.to(w.dtype)
            if NATIVE:
                acc += tl.dot(a, w)
            else:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        tl.store(out + pair[:, None].to(tl.int64) * H + rh[None, :], acc.to(out.dtype.element_ty),
                 mask=jmask[:, None] & hmask[None, :])


@checked
def moe_experts(x: Float[Tensor, "num_tokens hidden"], w13: Float[Tensor, "experts _ hidden"],
                w_down: Float[Tensor, "experts intermediate hidden"], experts: Int[Tensor, "num_tokens topk"],
                weights: Float[Tensor, "num_tokens topk"], act: str = "silu") -> Float[Tensor, "num_tokens hidden"]:
    if use_reference(__name__, x, w13, w_down):
        return ref.moe_experts(x, w13, w_down, experts, weights, act)
    T, K = experts.shape
    E, I, H = w_down.shape
    flat = experts.flatten()
    sorted_e, order = torch.sort(flat, stable=True)
    # Not torch.bincount: on CUDA it reads the largest id on the host, which a graph capture refuses.
    counts = torch.zeros(E, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    P = T * K
    pair_act = torch.empty(P, I, dtype=torch.float32, device=x.device)   # act(gate) * up * weight per pair
    out = torch.empty(P, H, dtype=x.dtype, device=x.device)
    # BT tokens of a run at a time: a run of distinct-expert tokens is at most T long (one pass
    # for a small step), tl.dot needs tiles of 16 or more, and the tiles stay in registers.
    BT = min(64, max(16, triton.next_power_of_2(T)))
    # 16-bit weights: tensor-core products (NATIVE). The interpreter's 16-bit tl.dot is wrong
    # (triton 3.9), so there it multiplies the same 16-bit values in fp32, which is exact.
    dot16 = w13.dtype in (torch.float16, torch.bfloat16)
    native = dot16 and not interpreting()
    BI, BH = 32, 64
    _moe_gate_up_kernel[(P, triton.cdiv(I, BI))](
        x, w13, order, sorted_e, counts, weights.contiguous().view(-1), pair_act, H, I, K,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), BT=BT, BI=BI, BH=BH, NATIVE=native,
        ACT=ACTS[act], num_warps=4)
    _moe_down_kernel[(P, triton.cdiv(H, BH))](
        pair_act, w_down, order, sorted_e, counts, out, H, I,
        w_down.stride(0), w_down.stride(1), w_down.stride(2), BT=BT, BI=BI, BH=BH, DOT16=dot16, NATIVE=native,
        num_warps=4)
    return out.view(T, K, H).sum(1)
