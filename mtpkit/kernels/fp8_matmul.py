"""Block-scaled FP8 matmul: the torch reference (the "torch" backend's Ops.fp8_linear /
fp8_batched, and the CPU path) of the Triton kernel in triton_fp8_matmul.py, same names,
signatures and semantics.

The fine-grained FP8 format of DeepSeek-V3 / Qwen3-Next-FP8 checkpoints: a weight W [N, K] is
stored as float8_e4m3fn with one float32 `scale_inv` per [block_n, block_k] block (the last
partial block of a dim uses its own scale), so W = Wq * scale_inv broadcast over each block.
At run time the activation is quantized the same way along K, one scale per token and group
of block_k (dynamic activation scheme), and y = x W^T sums, per K group, the FP8 product of
the group times the two scales: what serving engines run on Hopper, whose tensor cores take
FP8 inputs with fp32 accumulation.

Row scales: in the block layout row n of W uses scale row n // block_n. A weight merged from
checkpoint tensors whose parts are not whole blocks (layers/fp8_layout.py) instead names each
row's scale row: `scale_rows` [N], an index into its scale table (each row keeps the scale of
the block it was stored in).

Entry points (the Ops fields): `fp8_linear` (x @ W^T, any leading dims of x) and
`fp8_batched` (a batch of products over a weight stack: the MoE's experts) quantize the
activation, then run `fp8_block_matmul` (2-D) or `fp8_batched_matmul`, the typed
boundaries as the kernel takes them. The helpers around them (quantize / dequantize /
row_scales) and the entry points take any leading dims (expert stacks, tokens x heads), like
the linear family in layers/linear.py, so their tensors are plain Tensor.
"""

import torch

from mtpkit.shapes import Float, Int, Shaped, Tensor, checked

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero group would otherwise divide by zero.
_MIN_AMAX = 1e-10


def row_scales(scale: Tensor, rows: int, block_n: int, scale_rows: Tensor | None = None) -> Tensor:
    """Each weight row's scales [..., rows, groups]: row n's scale row n // block_n, or
    scale_rows[n] when the weight names them (leading batch dims kept)."""
    if scale_rows is not None:
        return scale.index_select(-2, scale_rows)
    return scale.repeat_interleave(block_n, dim=-2)[..., :rows, :]


def expand_scales(scale: Tensor, rows: int, cols: int, block: tuple[int, int],
                  scale_rows: Tensor | None = None) -> Tensor:
    """A per-block scale tensor broadcast to every element of a [rows, cols] matrix (leading
    batch dims kept, e.g. the experts of a fused MoE weight)."""
    return row_scales(scale, rows, block[0], scale_rows).repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype, scale_rows: Tensor | None = None) -> Tensor:
    """The checkpoint's weight in `dtype`: Wq * scale_inv per block (one scale per tensor when
    `block` is None). Any leading dims (fused experts [E, N, K] with scales [E, gn, gk]).
    Computed in fp32 and rounded once to `dtype`."""
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if block is None:
        return (w * s).to(dtype)
    return (w * expand_scales(s, w.shape[-2], w.shape[-1], block, scale_rows)).to(dtype)


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


def _activation(xq: Tensor, x_scale: Tensor, block_k: int) -> Tensor:
    """The quantized activation in fp32, any leading dims."""
    return dequantize(xq.unsqueeze(-2), x_scale.unsqueeze(-2), (1, block_k), torch.float32).squeeze(-2)


@checked
def fp8_block_matmul(xq: Shaped[Tensor, "num_tokens in_features"], x_scale: Float[Tensor, "num_tokens in_groups"],
                     wq: Shaped[Tensor, "out_features in_features"], w_scale: Float[Tensor, "out_groups in_groups"],
                     block: tuple[int, int], out_dtype: torch.dtype,
                     scale_rows: Int[Tensor, "out_features"] | None = None) -> Float[Tensor, "num_tokens out_features"]:
    """y = dequant(xq) @ dequant(wq)^T in fp32, rounded once to out_dtype: the kernel's
    arithmetic (each FP8 product is exact in fp32; only the summation order differs)."""
    w = dequantize(wq, w_scale, block, torch.float32, scale_rows)
    return (_activation(xq, x_scale, block[1]) @ w.t()).to(out_dtype)


@checked
def fp8_batched_matmul(xq: Shaped[Tensor, "matmuls num_rows in_features"],
                       x_scale: Float[Tensor, "matmuls num_rows in_groups"],
                       wq: Shaped[Tensor, "experts out_features in_features"],
                       w_scale: Float[Tensor, "experts out_groups in_groups"], block: tuple[int, int],
                       out_dtype: torch.dtype, experts: Int[Tensor, "matmuls"] | None = None,
                       scale_rows: Int[Tensor, "out_features"] | None = None
                       ) -> Float[Tensor, "matmuls num_rows out_features"]:
    """Product b = x[b] @ W[experts[b]]^T (W[b] without `experts`) for a stack of block-scaled
    weights sharing one row layout: fp8_block_matmul per product."""
    if experts is not None:
        wq, w_scale = wq.index_select(0, experts), w_scale.index_select(0, experts)
    w = dequantize(wq, w_scale, block, torch.float32, scale_rows)
    return torch.matmul(_activation(xq, x_scale, block[1]), w.transpose(-1, -2)).to(out_dtype)


def quantize_batch(x: Tensor, products: int, group: int) -> tuple[Tensor, Tensor]:
    """x [B, M, K] quantized per token and group of `group` as (xq [B, M, K], scale [B, M, G]);
    x [1, M, K] (the same rows for every product) is quantized once and expanded to
    `products`."""
    M, K = x.shape[1], x.shape[2]
    xq, xs = quantize_activation(x.reshape(-1, K), group)
    return xq.view(-1, M, K).expand(products, M, K), xs.view(-1, M, xs.shape[-1]).expand(products, M, xs.shape[-1])


def fp8_linear(x: Tensor, wq: Tensor, w_scale: Tensor, block: tuple[int, int],
               scale_rows: Tensor | None = None) -> Tensor:
    """x @ W^T for an FP8 block-scaled W, any leading dims of x: the activation quantized
    per token and group, then `fp8_block_matmul`. Output in x's dtype."""
    lead = x.shape[:-1]
    xq, xs = quantize_activation(x.reshape(-1, x.shape[-1]), block[1])
    return fp8_block_matmul(xq, xs, wq, w_scale, block, x.dtype, scale_rows).view(*lead, wq.shape[0])


def fp8_batched(x: Tensor, wq: Tensor, w_scale: Tensor, block: tuple[int, int],
                experts: Tensor | None = None, scale_rows: Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> Tensor:
    """x [B, M, K] @ W[experts[b]]^T per b over a stack of FP8 weights (W[b] without experts;
    x [1, M, K]: the same rows for every weight, quantized once), then `fp8_batched_matmul`.
    Output in out_dtype (default x's)."""
    B = wq.shape[0] if experts is None else experts.shape[0]
    xq, xs = quantize_batch(x, B, block[1])
    return fp8_batched_matmul(xq, xs, wq, w_scale, block, out_dtype or x.dtype, experts, scale_rows)
