"""RMSNorm (Qwen3-Next's zero-centred weight is the family's choice), per-head norms and GDN's
gated norm; their fused forms are kernels (mtpkit/kernels/elementwise.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.kernels import elementwise
from mtpkit.shapes import Float, Tensor, checked


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of Qwen3-Next: y = norm(x) * (1 + w), in fp32, cast back at the end.
    With a residual it is also the residual add before the norm (one fused op on Triton):
    `forward(x, residual)` -> (norm(residual + x), residual + x). `ops`: the attention
    backend, whose fused glue it runs (kernels/elementwise.py's torch references without one)."""

    def __init__(self, dim: int, eps: float, ops=None):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def scale(self, dtype: torch.dtype) -> Tensor:
        """1 + w in `dtype` (the weight is added to 1 in fp32 at least, as the reference does)."""
        w = self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        return w + 1.0

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"], residual: Float[Tensor, "num_tokens hidden"] | None = None
                ) -> Float[Tensor, "num_tokens hidden"] | tuple[Float[Tensor, "num_tokens hidden"],
                                                              Float[Tensor, "num_tokens hidden"]]:
        ops = self.ops or elementwise
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, True)
        return ops.add_rms_norm(x, residual, self.weight, self.eps, True)


def rms_norm_heads(x: Float[Tensor, "num_tokens qk_heads head_dim"], norms: list[tuple[RMSNorm, int]]
                   ) -> Float[Tensor, "num_tokens qk_heads head_dim"]:
    """Several zero-centred RMSNorms over consecutive head groups of x [..., heads, head_dim]
    (norms: (norm, its head count) in order) as one normalisation and one product with the
    stacked scales: the same values as norming each group and concatenating (bit for bit on
    CPU: rms_norm with a weight multiplies by it last), with two ops instead of one per group
    plus the slices and the cat. The scales are constants in a traced graph."""
    if len({n.eps for n, _ in norms}) > 1:
        raise ValueError("rms_norm_heads: the norms' eps differ")
    xf = elementwise.as_float(x)
    scale = torch.cat([n.scale(xf.dtype).expand(h, x.shape[-1]) for n, h in norms])
    y = F.rms_norm(xf, (x.shape[-1],), None, norms[0][0].eps) * scale
    return y if y.dtype == x.dtype else y.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: rmsnorm(x) * w * silu(z), plain weight (initialised to 1); the
    backend's (`ops`) fused kernel, or elementwise.gated_rms_norm."""

    def __init__(self, dim: int, eps: float, ops=None):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    @checked
    def forward(self, x: Float[Tensor, "num_tokens v_heads v_dim"], z: Float[Tensor, "num_tokens v_heads v_dim"]
                ) -> Float[Tensor, "num_tokens v_heads v_dim"]:
        return (self.ops or elementwise).gated_rms_norm(x, z, self.weight, self.eps)
