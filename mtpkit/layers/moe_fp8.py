"""A MoE block's experts kept in FP8 (FP8 mode, see fp8_layout.py), with SparseMoE's three
execution paths run through the block-scaled FP8 matmul.

The experts are two stacks laid out as the checkpoints store them, never requantized: w13
[local experts, 2I, hidden] (each expert's gate then up rows: from experts.{e}.gate_proj /
up_proj, or a fused experts.gate_up_proj) and down [local experts, hidden, I] (from
experts.{e}.down_proj or a fused experts.down_proj), each with its block scales; a gate / up
pair that is not whole blocks (I % block_n != 0) keeps each row's own scale
(fp8_layout.RowLayout.scale_rows). The plain layout's single down matmul over
[shared | experts] columns would need every expert's I columns to be whole blocks, so here the
experts' down projections are a batched matmul (one product per expert, or per token-expert
pair) summed in fp32, and the shared expert's down projection is its own weight
(`shared_down`, a row-parallel shard widened to whole blocks when TP cuts one).

Paths (chosen by SparseMoE._experts from the step's shape, as in the plain layout):
- dense: every local expert for every token: the stack's products share the quantized x;
- sparse: each token-expert pair's expert gathered by index inside the kernel (a decode step
  reads only the chosen experts' blocks, once per pair);
- grouped: one product per expert hit (prefill), on that expert's tokens.
The fused MoE kernel (Ops.moe_experts) stays for 16-bit and fp32 weights; these paths run the
block's `ops`' FP8 batched matmul (Ops.fp8_batched: triton_fp8_matmul.py's kernel on the
"triton" backend, its torch reference in fp8_matmul.py on the "torch" one).
"""

import dataclasses

import torch
from torch import nn

from mtpkit.checkpoint.weights import WeightSpec
from mtpkit.kernels.ops import Ops
from mtpkit.layers.fp8_layout import (
    Columns,
    FP8Matrix,
    FP8Rows,
    Part,
    row_layout,
    row_sources,
)
from mtpkit.shapes import Float, Tensor


@dataclasses.dataclass(frozen=True)
class MoENames:
    """A MoE block's checkpoint tensors (FP8 scales are named after their weights)."""
    router: str                      # [experts, hidden]
    experts: str                     # "<block>.experts": {e}.gate_proj.weight ... or fused gate_up_proj, down_proj
    fused: bool                      # experts stored fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    shared: str | None = None        # "<block>.shared_expert": gate_proj / up_proj / down_proj .weight
    shared_gate: str | None = None   # the shared expert's sigmoid gate [1, hidden]


def in_parts(moe, names: MoENames) -> list[Part]:
    """w_in's rows: the router, then the shared expert's gate, and this rank's gate and up rows."""
    E, S = moe.num_experts, moe.shared_inter
    parts = [Part(names.router, E, 0, E)]
    if moe.s:
        s0, sl = moe.shared_range
        parts += [Part(names.shared_gate, 1, 0, 1), Part(f"{names.shared}.gate_proj.weight", S, s0, sl),
                  Part(f"{names.shared}.up_proj.weight", S, s0, sl)]
    return parts


class FP8Experts(nn.Module):
    """The experts' two FP8 stacks (and the shared expert's down projection), their matmuls
    `ops`' (the torch references without)."""

    def __init__(self, moe, names: MoENames, block: tuple[int, int], fp8_names, ops: Ops | None = None):
        super().__init__()
        E, I, H, nl, first = moe.num_experts, moe.inter, moe.hidden, moe.num_local, moe.first
        ex = names.experts
        if names.fused:
            self.w13_parts = [[Part(f"{ex}.gate_up_proj", 2 * I, 0, 2 * I)]] * nl
            self.down_parts = [[Part(f"{ex}.down_proj", H, 0, H)]] * nl
            self.fused = (first, E)
        else:
            self.w13_parts = [[Part(f"{ex}.{e}.gate_proj.weight", I, 0, I), Part(f"{ex}.{e}.up_proj.weight", I, 0, I)]
                              for e in range(E)]
            self.down_parts = [[Part(f"{ex}.{e}.down_proj.weight", H, 0, H)] for e in range(E)]
            self.fused = None
        self.mine = slice(0, nl) if names.fused else slice(first, first + nl)  # this rank's entries
        bn = block[0]
        self.w13 = FP8Matrix(row_layout(*row_sources(self.w13_parts[0], None), bn), Columns(H, 0, H), block, (nl,),
                             ops)
        self.down = FP8Matrix(row_layout(*row_sources(self.down_parts[0], None), bn), Columns(I, 0, I), block, (nl,),
                              ops)
        self.down.weight.expert_down = True  # [experts, hidden, I]: not a per-token width (memory_plan)
        # The shared expert's down projection: this rank's columns (FP8 or plain as stored).
        self.shared_down = (FP8Rows([Part(f"{names.shared}.down_proj.weight", H, 0, H)], None,
                                    Columns(moe.shared_inter, *moe.shared_range), block, fp8_names, ops)
                            if moe.s else None)

    @staticmethod
    def build(moe, names: MoENames, block: tuple[int, int], fp8_names, ops: Ops | None = None
              ) -> "FP8Experts | None":
        """The experts in FP8 when every one of them is FP8 in the checkpoint; None otherwise
        (then they load in the plain layout, dequantized)."""
        ex, E = names.experts, moe.num_experts
        stored = ([f"{ex}.gate_up_proj", f"{ex}.down_proj"] if names.fused else
                  [f"{ex}.{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up", "down")])
        if not all(n in fp8_names for n in stored):
            return None
        return FP8Experts(moe, names, block, fp8_names, ops)

    def specs(self) -> list[WeightSpec]:
        shared = self.shared_down.specs() if self.shared_down is not None else []
        w13, down = self.w13_parts, self.down_parts   # every expert's, declared; this rank's, read
        return (self.w13.specs(w13[self.mine], self.fused, w13) + self.down.specs(down[self.mine], self.fused, down)
                + shared)

    # ---- the three paths (SparseMoE._experts chooses; `moe` routes and activates) --------
    def _finish(self, moe, out: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"],
                dtype: torch.dtype) -> Float[Tensor, "num_tokens hidden"]:
        """The routed sum (fp32) plus the shared expert, rounded once to the model dtype."""
        if moe.s:
            out = out + self.shared_down(moe._shared_act(h))
        return out.to(dtype)

    def dense(self, moe, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
              ) -> Float[Tensor, "num_tokens hidden"]:
        T, E, nl, I = x.shape[0], moe.num_experts, moe.num_local, moe.inter
        weights, experts = moe.route(h[:, :E])
        gate = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter(1, experts, weights)
        gu = self.w13.batched(x[None])                                          # [nl, T, 2I]
        act = moe.activation(gu[..., :I]) * gu[..., I:] * gate[:, moe.first:moe.first + nl].t()[:, :, None]
        return self._finish(moe, self.down.batched(act, out_dtype=torch.float32).sum(0), h, x.dtype)

    def sparse(self, moe, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
               ) -> Float[Tensor, "num_tokens hidden"]:
        T, K, E, I = x.shape[0], moe.topk, moe.num_experts, moe.inter
        weights, experts = moe.route(h[:, :E])
        local, weights = moe._local(experts, weights)
        gu = self.w13.batched(x.repeat_interleave(K, dim=0)[:, None], local)   # [T*K, 1, 2I]
        act = moe.activation(gu[..., :I]) * gu[..., I:] * weights.reshape(T * K, 1, 1)
        out = self.down.batched(act, local, torch.float32).view(T, K, -1).sum(1)
        return self._finish(moe, out, h, x.dtype)

    def grouped(self, moe, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
                ) -> Float[Tensor, "num_tokens hidden"]:
        E, I = moe.num_experts, moe.inter
        weights, experts = moe.route(h[:, :E])
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        token_of, start = order // moe.topk, 0
        for e, c in enumerate(counts):
            idx, tok = order[start:start + c], token_of[start:start + c]
            start += c
            local = e - moe.first
            if c == 0 or not 0 <= local < moe.num_local:  # not routed here, or another rank's
                continue
            one = torch.full((1,), local, dtype=torch.int64, device=x.device)
            gu = self.w13.batched(x[tok][None], one)[0]
            act = moe.activation(gu[:, :I]) * gu[:, I:] * weights.flatten()[idx, None]
            out.index_add_(0, tok, self.down.batched(act[None], one, torch.float32)[0])
        return self._finish(moe, out, h, x.dtype)
