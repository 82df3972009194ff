"""The routed experts of a decode / verify step: the torch reference (the "torch" backend's
Ops.moe_experts) of the fused Triton MoE in triton_moe.py, same name, signature and semantics.

out[t] = sum_j weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = experts[t, j],
with w13[e] = [gate rows; up rows] ([2I, H]) and w_down[e] = the expert's down projection as
an [I, H] block (the transpose of the checkpoint's [H, I]; SparseMoE holds it as a view of
w_out's columns), act one of elementwise.ACTIVATIONS (silu; Gemma 4's gelu_tanh). Each
token-expert pair is computed on its own.
"""

import torch

from mtpkit.shapes import Float, Int, Tensor, checked
from mtpkit.kernels.elementwise import ACTIVATIONS


@checked
def moe_experts(x: Float[Tensor, "num_tokens hidden"], w13: Float[Tensor, "experts _ hidden"],
                w_down: Float[Tensor, "experts intermediate hidden"], experts: Int[Tensor, "num_tokens topk"],
                weights: Float[Tensor, "num_tokens topk"], act: str = "silu") -> Float[Tensor, "num_tokens hidden"]:
    T, K = experts.shape
    local = experts.flatten()
    if torch.compiler.is_compiling():
        # Compiled (inductor): the products written as multiply + sum, which inductor generates as
        # fused C++ loops over the chosen experts' rows, where batched matmuls would call the
        # BLAS on gathered copies (measured: docs/performance.md, "Inside the aot-tuned graphs").
        gu = (w13.index_select(0, local) * x.repeat_interleave(K, dim=0)[:, None, :]).sum(-1)   # [T*K, 2I]
        g, u = gu.chunk(2, dim=1)
        a = ACTIVATIONS[act](g) * u * weights.reshape(T * K, 1)                                  # [T*K, I]
        return (a[:, :, None] * w_down.index_select(0, local)).sum(1).view(T, K, -1).sum(1)
    xs = x.repeat_interleave(K, dim=0)[:, :, None]                              # [T*K, H, 1]
    g, u = torch.matmul(w13.index_select(0, local), xs).chunk(2, dim=1)        # [T*K, I, 1]
    a = ACTIVATIONS[act](g) * u * weights.reshape(T * K, 1, 1)
    return torch.matmul(a.transpose(1, 2), w_down.index_select(0, local)).view(T, K, -1).sum(1)
