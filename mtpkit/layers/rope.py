"""Rotary position embedding over the first `rotary_dim` dims of a head (partial RoPE).
"""

import torch
from torch import nn

from mtpkit.shapes import Float, Int, Tensor, checked


class PartialRoPE(nn.Module):
    """rotate_half RoPE on the first rot_dim dims of each head; frequencies in fp32 as the
    reference computes them, so logits match it.

    Written over the whole head: angles are 0 past rot_dim (cos 1, sin 0), and rotate_half
    is a signed permutation matrix (zero past rot_dim), so x * cos + (x @ P) * sin is the
    reference's arithmetic on the rotated dims and leaves the others exactly as they were,
    in four ops instead of a dozen slices and concatenations."""

    def __init__(self, head_dim: int, rot_dim: int, theta: float):
        super().__init__()
        self.rot_dim = rot_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
        full = torch.zeros(head_dim)
        full[:rot_dim] = torch.cat([inv_freq, inv_freq])
        self.register_buffer("inv_freq_full", full, persistent=False)
        half, idx = rot_dim // 2, torch.arange(rot_dim // 2)
        P = torch.zeros(head_dim, head_dim)
        P[idx + half, idx] = -1.0        # out[i] = -x[i + half]   (i < half)
        P[idx, idx + half] = 1.0         # out[i + half] = x[i]
        self.register_buffer("rotate_half", P, persistent=False)

    @checked
    def forward(self, positions: Int[Tensor, "num_tokens"], x: Float[Tensor, "num_tokens qk_heads head_dim"]
                ) -> Float[Tensor, "num_tokens qk_heads head_dim"]:
        return self.rotate(x, *self.cos_sin(positions))

    def cos_sin(self, positions: Int[Tensor, "num_tokens"]) -> tuple[Float[Tensor, "num_tokens 1 head_dim"],
                                                                      Float[Tensor, "num_tokens 1 head_dim"]]:
        """The angles' cos and sin at `positions` (fp32): what every layer with these RoPE
        parameters shares in a step (a model may compute them once for all of them)."""
        angles = positions[:, None].float() * self.inv_freq_full             # [T, head_dim]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rotate(self, x: Float[Tensor, "num_tokens qk_heads head_dim"], cos: Float[Tensor, "num_tokens 1 head_dim"],
               sin: Float[Tensor, "num_tokens 1 head_dim"]) -> Float[Tensor, "num_tokens qk_heads head_dim"]:
        P = self.rotate_half
        if x.dtype != cos.dtype:
            cos, sin, P = cos.to(x.dtype), sin.to(x.dtype), P.to(x.dtype)
        return x * cos + (x @ P) * sin
