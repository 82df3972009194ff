"""Block-scaled FP8 matmul, the torch reference (the Triton kernel is triton_fp8_matmul.py).

The fine-grained FP8 format of DeepSeek-V3 / Qwen3-Next-FP8 checkpoints: a weight W [N, K] is
stored as float8_e4m3fn with one float32 `scale_inv` per [block_n, block_k] block (the last
partial block of a dim uses its own scale), so W = Wq * scale_inv broadcast over each block.
At run time the activation is quantized the same way along K, one scale per token and group
of block_k (dynamic activation scheme), and y = x W^T sums, per K group, the FP8 product of
the group times the two scales: what serving engines run on Hopper, whose tensor cores take
FP8 inputs with fp32 accumulation.

Typing: `fp8_block_matmul` (2-D operands, as the kernel takes them) is the typed boundary; the
helpers around it (quantize / dequantize / expand_scales, fp8_linear_reference) take any
leading dims (expert stacks, tokens x heads), like the linear family in models/layers.py, so
their tensors are plain Tensor.
"""

import torch

from ..shapes import Float, Shaped, Tensor, checked

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero group would otherwise divide by zero.
_MIN_AMAX = 1e-10


def expand_scales(scale: Tensor, rows: int, cols: int,
                  block: tuple[int, int]) -> Tensor:
    """A per-block scale tensor broadcast to every element of a [rows, cols] matrix (leading
    batch dims kept, e.g. the experts of a fused MoE weight)."""
    s = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> Tensor:
    """The checkpoint's weight in `dtype`: Wq * scale_inv per block (one scale per tensor when
    `block` is None). Any leading dims (fused experts [E, N, K] with scales [E, gn, gk]).
    Computed in fp32 and rounded once to `dtype`."""
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if block is None:
        return (w * s).to(dtype)
    return (w * expand_scales(s, w.shape[-2], w.shape[-1], block)).to(dtype)


def quantize(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(Wq float8_e4m3fn, scale_inv float32 [ceil(N/bn), ceil(K/bk)]) with each block's
    absolute maximum mapped to the FP8 maximum: the checkpoints' format (any leading dims)."""
    w = weight.to(torch.float32)
    *lead, n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*lead, gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w
    blocks = padded.unflatten(-1, (gk, bk)).unflatten(-3, (gn, bn))          # [..., gn, bn, gk, bk]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(_MIN_AMAX)               # [..., gn, gk]
    scale_inv = amax / FP8_MAX
    q = (w / expand_scales(scale_inv, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale_inv


@checked
def quantize_activation(x: Float[Tensor, "num_tokens in_features"], group: int
                        ) -> tuple[Shaped[Tensor, "num_tokens in_features"], Float[Tensor, "num_tokens in_groups"]]:
    """Per-token, per-group-of-`group` dynamic quantization of the activation (the last
    group may be partial): (xq float8_e4m3fn, scale float32)."""
    q, s = quantize(x[:, None, :], (1, group))
    return q[:, 0], s[:, 0]


@checked
def fp8_block_matmul(xq: Shaped[Tensor, "num_tokens in_features"], x_scale: Float[Tensor, "num_tokens in_groups"],
                     wq: Shaped[Tensor, "out_features in_features"], w_scale: Float[Tensor, "out_groups in_groups"],
                     block: tuple[int, int], out_dtype: torch.dtype) -> Float[Tensor, "num_tokens out_features"]:
    """y = dequant(xq) @ dequant(wq)^T in fp32, rounded once to out_dtype: the kernel's
    arithmetic (each FP8 product is exact in fp32; only the summation order differs)."""
    x = dequantize(xq[:, None, :], x_scale[:, None, :], (1, block[1]), torch.float32)[:, 0]
    w = dequantize(wq, w_scale, block, torch.float32)
    return (x @ w.t()).to(out_dtype)


def fp8_linear_reference(x: Tensor, wq: Tensor, w_scale: Tensor, block: tuple[int, int]) -> Tensor:
    """x @ W^T for an FP8 block-scaled W, any leading dims of x: the activation quantized
    per token and group, then `fp8_block_matmul`. Output in x's dtype."""
    lead = x.shape[:-1]
    xq, xs = quantize_activation(x.reshape(-1, x.shape[-1]), block[1])
    return fp8_block_matmul(xq, xs, wq, w_scale, block, x.dtype).view(*lead, wq.shape[0])
