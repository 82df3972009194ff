"""Triton kernel of the block-scaled FP8 matmul (the "triton" backend's Ops.fp8_linear /
fp8_batched), beside its torch reference in fp8_matmul.py (same names, signatures and
semantics; tested against it under TRITON_INTERPRET=1 and compiled for sm_90 in
tests/test_triton_compile.py).

One kernel for a single product (the linear layers) and a batch of them over a weight stack
(the MoE's experts: every expert for every token, or each token-expert pair's own expert,
gathered by index). Grid (cdiv(M, BM), cdiv(N, BN), products). Per K step of block_k: one
FP8 x FP8 tensor-core product with fp32 accumulation (exact per element), scaled by
x_scale[m] * w_scale[scale row of n] and added to the fp32 accumulator; the result is
rounded once to the output dtype. A row's scale row is n // block_n (block layout) or read
from `scale_rows` (a merged weight whose parts are not whole blocks); it is fixed over K, so
a program loads its BN row indices once. Partial last blocks are masked (zeros add nothing).
"""

import torch
import triton
import triton.language as tl

from mtpkit.shapes import Float, Int, Shaped, Tensor, checked

from mtpkit.kernels import fp8_matmul as ref
from mtpkit.kernels.triton_common import use_reference

__all__ = ["fp8_block_matmul", "fp8_batched_matmul", "fp8_linear", "fp8_batched"]

BN = 128  # output columns per program


@triton.jit
def _fp8_block_matmul_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, rows_ptr, sel_ptr, out_ptr, M, N, K,
                             sx_b, sx_m, sx_k, sxs_b, sxs_m, sxs_g, sw_e, sw_n, sw_k, sws_e, sws_n, sws_g,
                             so_b, so_m, so_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             BLOCK_N: tl.constexpr, INDEXED: tl.constexpr, GATHER: tl.constexpr):
    pid_m, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    e = b
    if GATHER:  # the product's weight in the stack, by index
        e = tl.load(sel_ptr + b).to(tl.int64)
    offm = pid_m * BM + tl.arange(0, BM)
    offn = pid_n * BN + tl.arange(0, BN)
    offk = tl.arange(0, BK)
    mm, mn = offm < M, offn < N
    if INDEXED:
        srow = tl.load(rows_ptr + offn, mask=mn, other=0)
    else:
        srow = offn // BLOCK_N
    x_ptr += b * sx_b
    xs_ptr += b * sxs_b
    w_ptr += e * sw_e
    ws_ptr += e * sws_e
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BK)):
        k = g * BK + offk
        mk = k < K
        a = tl.load(x_ptr + offm[:, None] * sx_m + k[None, :] * sx_k, mask=mm[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptr + offn[None, :] * sw_n + k[:, None] * sw_k, mask=mn[None, :] & mk[:, None], other=0.0)
        a_s = tl.load(xs_ptr + offm * sxs_m + g * sxs_g, mask=mm, other=0.0)
        w_s = tl.load(ws_ptr + srow * sws_n + g * sws_g, mask=mn, other=0.0)
        acc += tl.dot(a, w, out_dtype=tl.float32) * (a_s[:, None] * w_s[None, :])
    tl.store(out_ptr + b * so_b + offm[:, None] * so_m + offn[None, :] * so_n, acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def _launch(xq, xs, wq, ws, block, out, experts, scale_rows):
    """xq [B, M, K], xs [B, M, G], wq [E, N, K], ws [E, SN, G], out [B, M, N]."""
    B, M, K = xq.shape
    N = wq.shape[1]
    BM = 16 if M <= 16 else 64  # decode steps and token-expert pairs have few rows (tl.dot needs 16)
    dummy = out  # an unread pointer where a feature is off
    _fp8_block_matmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), B)](
        xq, xs, wq, ws, dummy if scale_rows is None else scale_rows, dummy if experts is None else experts, out,
        M, N, K, xq.stride(0), xq.stride(1), xq.stride(2), xs.stride(0), xs.stride(1), xs.stride(2),
        wq.stride(0), wq.stride(1), wq.stride(2), ws.stride(0), ws.stride(1), ws.stride(2),
        out.stride(0), out.stride(1), out.stride(2), BM=BM, BN=BN, BK=block[1], BLOCK_N=block[0],
        INDEXED=scale_rows is not None, GATHER=experts is not None, num_warps=4)
    return out


@checked
def fp8_block_matmul(xq: Shaped[Tensor, "num_tokens in_features"], x_scale: Float[Tensor, "num_tokens in_groups"],
                     wq: Shaped[Tensor, "out_features in_features"], w_scale: Float[Tensor, "out_groups in_groups"],
                     block: tuple[int, int], out_dtype: torch.dtype,
                     scale_rows: Int[Tensor, "out_features"] | None = None) -> Float[Tensor, "num_tokens out_features"]:
    if use_reference(__name__, xq):
        return ref.fp8_block_matmul(xq, x_scale, wq, w_scale, block, out_dtype, scale_rows)
    out = torch.empty(xq.shape[0], wq.shape[0], dtype=out_dtype, device=xq.device)
    _launch(xq[None], x_scale[None], wq[None], w_scale[None], block, out[None], None, scale_rows)
    return out


@checked
def fp8_batched_matmul(xq: Shaped[Tensor, "matmuls num_rows in_features"],
                       x_scale: Float[Tensor, "matmuls num_rows in_groups"],
                       wq: Shaped[Tensor, "experts out_features in_features"],
                       w_scale: Float[Tensor, "experts out_groups in_groups"], block: tuple[int, int],
                       out_dtype: torch.dtype, experts: Int[Tensor, "matmuls"] | None = None,
                       scale_rows: Int[Tensor, "out_features"] | None = None
                       ) -> Float[Tensor, "matmuls num_rows out_features"]:
    if use_reference(__name__, xq):
        return ref.fp8_batched_matmul(xq, x_scale, wq, w_scale, block, out_dtype, experts, scale_rows)
    out = torch.empty(xq.shape[0], xq.shape[1], wq.shape[1], dtype=out_dtype, device=xq.device)
    return _launch(xq, x_scale, wq, w_scale, block, out, experts, scale_rows)


def fp8_linear(x: Tensor, wq: Tensor, w_scale: Tensor, block: tuple[int, int],
               scale_rows: Tensor | None = None) -> Tensor:
    # Any leading dims of x (the linear family's contract): fp8_block_matmul is the typed boundary.
    """Triton version of fp8_matmul.fp8_linear: x @ W^T for an FP8 block-scaled W (any leading
    dims of x), the activation quantized per token and group of block_k (in torch: a handful
    of elementwise ops)."""
    if use_reference(__name__, x):
        return ref.fp8_linear(x, wq, w_scale, block, scale_rows)
    lead = x.shape[:-1]
    xq, xs = ref.quantize_activation(x.reshape(-1, x.shape[-1]), block[1])
    return fp8_block_matmul(xq, xs, wq, w_scale, block, x.dtype, scale_rows).view(*lead, wq.shape[0])


def fp8_batched(x: Tensor, wq: Tensor, w_scale: Tensor, block: tuple[int, int],
                experts: Tensor | None = None, scale_rows: Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> Tensor:
    """Triton version of fp8_matmul.fp8_batched: x [B, M, K] @ W[experts[b]]^T per b over a
    stack of FP8 weights (x [1, M, K] quantized once for every weight)."""
    if use_reference(__name__, x):
        return ref.fp8_batched(x, wq, w_scale, block, experts, scale_rows, out_dtype)
    B = wq.shape[0] if experts is None else experts.shape[0]
    xq, xs = ref.quantize_batch(x, B, block[1])
    return fp8_batched_matmul(xq, xs, wq, w_scale, block, out_dtype or x.dtype, experts, scale_rows)
