"""Triton kernel of the block-scaled FP8 matmul, beside its torch reference in fp8_matmul.py
(same signature and semantics; tested against it under TRITON_INTERPRET=1 and compiled for
sm_90 in tests/test_triton_compile.py).

Grid (cdiv(M, BM), cdiv(N, BN)), BN = block_n: a program's output columns lie in one weight
block row, so each K step needs one weight scale and BM activation scales. Per K step of
block_k: one FP8 x FP8 tensor-core product with fp32 accumulation (exact per element), scaled
by x_scale[m] * w_scale[n_block] and added to the fp32 accumulator; the result is rounded
once to the output dtype. Partial last blocks are masked (zeros add nothing).
"""

import torch
import triton
import triton.language as tl

from mtpkit.shapes import Float, Shaped, Tensor, checked

from . import fp8_matmul as ref
from .triton_common import use_reference

__all__ = ["fp8_block_matmul", "fp8_linear"]

BM = 64  # activation rows per program (decode steps have few: masked)


@triton.jit
def _fp8_block_matmul_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                             sx_m, sx_k, sxs_m, sxs_g, sw_n, sw_k, sws_n, sws_g, so_m, so_n,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offm = pid_m * BM + tl.arange(0, BM)
    offn = pid_n * BN + tl.arange(0, BN)
    offk = tl.arange(0, BK)
    mm, mn = offm < M, offn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BK)):
        k = g * BK + offk
        mk = k < K
        a = tl.load(x_ptr + offm[:, None] * sx_m + k[None, :] * sx_k, mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(w_ptr + offn[None, :] * sw_n + k[:, None] * sw_k, mask=mn[None, :] & mk[:, None], other=0.0)
        a_s = tl.load(xs_ptr + offm * sxs_m + g * sxs_g, mask=mm, other=0.0)
        b_s = tl.load(ws_ptr + pid_n * sws_n + g * sws_g)
        acc += tl.dot(a, b, out_dtype=tl.float32) * (a_s[:, None] * b_s)
    tl.store(out_ptr + offm[:, None] * so_m + offn[None, :] * so_n, acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@checked
def fp8_block_matmul(xq: Shaped[Tensor, "num_tokens in_features"], x_scale: Float[Tensor, "num_tokens in_groups"],
                     wq: Shaped[Tensor, "out_features in_features"], w_scale: Float[Tensor, "out_groups in_groups"],
                     block: tuple[int, int], out_dtype: torch.dtype) -> Float[Tensor, "num_tokens out_features"]:
    if use_reference("mtpkit.attn.triton_fp8_matmul", xq):
        return ref.fp8_block_matmul(xq, x_scale, wq, w_scale, block, out_dtype)
    M, K = xq.shape
    N = wq.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    bn, bk = block
    grid = (triton.cdiv(M, BM), triton.cdiv(N, bn))
    _fp8_block_matmul_kernel[grid](xq, x_scale, wq, w_scale, out, M, N, K,
                                   xq.stride(0), xq.stride(1), x_scale.stride(0), x_scale.stride(1),
                                   wq.stride(0), wq.stride(1), w_scale.stride(0), w_scale.stride(1),
                                   out.stride(0), out.stride(1), BM=BM, BN=bn, BK=bk, num_warps=4)
    return out


def fp8_linear(x: Tensor, wq: Tensor, w_scale: Tensor, block: tuple[int, int]) -> Tensor:
    # Any leading dims of x (the linear family's contract): fp8_block_matmul is the typed boundary.
    """x @ W^T for an FP8 block-scaled W (any leading dims of x), the activation quantized
    per token and group of block_k (in torch: a handful of elementwise ops)."""
    lead = x.shape[:-1]
    xq, xs = ref.quantize_activation(x.reshape(-1, x.shape[-1]), block[1])
    return fp8_block_matmul(xq, xs, wq, w_scale, block, x.dtype).view(*lead, wq.shape[0])
