"""The elementwise glue of a decoder layer around its matmuls: RMSNorms fused with the residual
add, the GDN output's gated norm, and gated activations. Torch references (the "torch"
backend's Ops.rms_norm ... act_mul, and the CPU path) of triton_elementwise.py's fused kernels;
same names, signatures and semantics.

Each function is the exact sequence of torch ops the layers ran before the kernels existed,
so its roundings are the model's: arithmetic in fp32 (fp64 stays fp64), every intermediate
that the unfused code rounds to the activation dtype rounded here too (a residual sum, a
sandwich norm's output, an activation before its product). Norm weights are in the model
dtype and applied as the layers did: Qwen3-Next's zero-centred scale 1 + w (added in fp32),
Gemma's plain w.
"""

import functools

import torch
import torch.nn.functional as F

from mtpkit.shapes import Float, Tensor, checked


# The helpers below take any shape (they act on dtypes and on the last dim: Gemma's
# q/k/v norms run norm_last_dim on [num_tokens, heads, head_dim]), so their tensors are plain.
def as_float(x: Tensor) -> Tensor:
    """fp32 for the norms' arithmetic (fp64 stays fp64); no op when already so."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def cast(y: Tensor, dtype: torch.dtype) -> Tensor:
    """y in `dtype`; no op when it already is (a traced `.to` of the same dtype is still a node
    that every replay dispatches)."""
    return y if y.dtype == dtype else y.to(dtype)


_cast = cast


def norm_last_dim(x: Tensor, weight: Tensor | None, eps: float, zero_centred: bool) -> Tensor:
    """RMSNorm over the last dim in fp32, cast back to x's dtype (layers.RMSNorm, GemmaRMSNorm)."""
    xf = as_float(x)
    w = None if weight is None else _cast(weight, xf.dtype)
    if zero_centred:
        w = w + 1.0
    return _cast(F.rms_norm(xf, (xf.shape[-1],), w, eps), x.dtype)


@checked
def rms_norm(x: Float[Tensor, "num_tokens hidden"], weight: Float[Tensor, "hidden"], eps: float,
             zero_centred: bool) -> Float[Tensor, "num_tokens hidden"]:
    """norm(x) * (1 + w) (zero_centred, Qwen3-Next) or norm(x) * w (Gemma)."""
    return norm_last_dim(x, weight, eps, zero_centred)


@checked
def add_rms_norm(x: Float[Tensor, "num_tokens hidden"], residual: Float[Tensor, "num_tokens hidden"],
                 weight: Float[Tensor, "hidden"], eps: float, zero_centred: bool
                 ) -> tuple[Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens hidden"]]:
    """(norm(s), s) with s = residual + x rounded to the activation dtype (the residual stream)."""
    s = residual + x
    return norm_last_dim(s, weight, eps, zero_centred), s


@checked
def norm_add_rms_norm(x: Float[Tensor, "num_tokens hidden"], residual: Float[Tensor, "num_tokens hidden"],
                      x_weight: Float[Tensor, "hidden"], weight: Float[Tensor, "hidden"], eps: float
                      ) -> tuple[Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens hidden"]]:
    """Gemma's sandwich after attention: s = residual + norm(x) * x_weight, then (norm(s) * weight, s)."""
    s = residual + norm_last_dim(x, x_weight, eps, False)
    return norm_last_dim(s, weight, eps, False), s


@checked
def norm_add(x: Float[Tensor, "num_tokens hidden"], residual: Float[Tensor, "num_tokens hidden"],
             x_weight: Float[Tensor, "hidden"], eps: float, scalar: Float[Tensor, "1"] | None
             ) -> Float[Tensor, "num_tokens hidden"]:
    """Gemma's end of a layer: (residual + norm(x) * x_weight) [* layer_scalar]."""
    s = residual + norm_last_dim(x, x_weight, eps, False)
    return s if scalar is None else s * scalar


@checked
def gated_rms_norm(x: Float[Tensor, "num_tokens v_heads v_dim"], z: Float[Tensor, "num_tokens v_heads v_dim"],
                   weight: Float[Tensor, "v_dim"], eps: float) -> Float[Tensor, "num_tokens v_heads v_dim"]:
    """GDN's output norm: rmsnorm(x) * w * silu(z) per head (layers.GatedRMSNorm)."""
    dtype = x.dtype
    if dtype in (torch.float32, torch.float64):  # w * norm(x) is then one rounding either way
        return F.rms_norm(x, (x.shape[-1],), weight, eps) * F.silu(z)
    # Lower precision: the reference rounds norm(x) to the input dtype before the weight.
    y = weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dtype)
    return (y * F.silu(z.float())).to(dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "sigmoid": torch.sigmoid}


@checked
def act_mul(g: Float[Tensor, "num_tokens gated_dim"], u: Float[Tensor, "num_tokens gated_dim"], act: str,
            row_gate: Float[Tensor, "num_tokens 1"] | None = None) -> Float[Tensor, "num_tokens gated_dim"]:
    """act(g) * u [* sigmoid(row_gate)], each product rounded to the activation dtype: an MLP's
    gate and up halves (silu; Gemma's gelu_tanh), the shared expert with its sigmoid gate, a
    gated attention output (act sigmoid: sigmoid(gate) * o)."""
    y = ACTIVATIONS[act](g) * u
    return y if row_gate is None else y * torch.sigmoid(row_gate)
