"""The sparse MoE block of Qwen3-Next: router, SwiGLU experts and a gated shared expert.

Router softmax over all experts in fp32, top-k, optional renormalisation; output = routed sum
+ sigmoid(shared_expert_gate(x)) * shared_expert(x).

Three weights hold everything:
- w_in [E + s + 2S, hidden]: the router (E rows), the shared-expert gate (s = 1 row, or none
  without a shared expert) and the shared expert's gate and up rows (S each): everything
  every token multiplies, in one matmul;
- w13 [local experts, 2I, hidden]: each of this rank's experts' gate then up rows, expert by
  expert (the checkpoints' fused layout), so one expert is one contiguous block;
- w_out [hidden, S + local experts * I]: the shared expert's down columns, then the experts'.
Scaling each expert's activation by its routing weight before the (linear) down projection
is the reference's weighted sum of expert outputs, so every expert and the shared expert can
share one down matmul.

Three ways to run it, chosen by the step's shape (never by its data, so every one can be
captured in a graph): a step choosing few experts (top-k of a handful of tokens) gathers just
their blocks (`_sparse`: a decode step reads k experts, not all of them); a small step computes
every expert (`_dense`: three matmuls); a large step (prefill, training) loops over the experts
hit (`_grouped`, which reads the routing on the host).

Tensor parallelism shards the experts: rank r holds whole experts r*E/size ... and computes
only their share of the routed sum (the router is replicated, so every rank routes alike);
the shared expert is split like an MLP. One all-reduce sums routed + shared together.
Whole experts (not slices of each) keep every expert's matmuls full-sized and let each rank
read only its experts from the checkpoint.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import TP
from ..shapes import Float, Int, Tensor, checked
from ..attn.fp8_matmul import dequantize
from .layers import fp8_linear, linear
from .moe_experts import moe_experts
from .weights import WeightSpec, narrow, read, shard_range


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, topk: int, intermediate: int,
                 shared_intermediate: int, norm_topk: bool, tp: TP, ops=None):
        super().__init__()
        self.tp, self.topk, self.norm_topk = tp, topk, norm_topk
        # The attention backend's moe_experts runs the sparse path's experts (the torch
        # reference without a backend, or a fused Triton kernel).
        self.ops = ops
        self.hidden, self.num_experts, self.inter = hidden, num_experts, intermediate
        self.num_local = tp.split(num_experts, what="num_experts")
        self.first = tp.rank * self.num_local  # global id of this rank's first expert
        self.shared_inter = shared_intermediate
        self.shared_range = (shard_range(shared_intermediate, 1, tp, "shared_expert_intermediate_size")
                             if shared_intermediate else (0, 0))
        self.s, S = int(shared_intermediate > 0), self.shared_range[1]
        self.w_in = nn.Parameter(torch.empty(num_experts + self.s + 2 * S, hidden), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * intermediate, hidden), requires_grad=False)
        self.w_out = nn.Parameter(torch.empty(hidden, S + self.num_local * intermediate), requires_grad=False)

    # ---- FP8 (CUDA): the experts' weights kept as stored, with their block scales ------------
    fp8_block: tuple[int, int] | None = None

    def fp8_shardable(self, block: tuple[int, int]) -> bool:
        """Whether w13 and w_out can be cut from the checkpoint's blocks: each expert's gate and
        up rows whole row blocks, and the down weights' columns (shared slice, then every
        expert's) whole column blocks."""
        bn, bk = block
        s0, sl = self.shared_range
        return self.inter % bn == 0 and self.inter % bk == 0 and s0 % bk == 0 and sl % bk == 0

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Keep w13 and w_out in FP8 with their scales (w13_scale [local, 2I/bn, ceil(H/bk)],
        w_out_scale [ceil(H/bn), (S + local*I)/bk]); w_in (router, shared gate and up rows)
        stays dequantized. Called before loading."""
        bn, bk = block
        self.fp8_block = block
        nl, I, H, cols = self.num_local, self.inter, self.hidden, self.w_out.shape[1]
        fp8 = torch.float8_e4m3fn
        self.w13 = nn.Parameter(torch.empty(nl, 2 * I, H, dtype=fp8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.empty(nl, 2 * I // bn, -(-H // bk)), requires_grad=False)
        self.w_out = nn.Parameter(torch.empty(H, cols, dtype=fp8), requires_grad=False)
        self.w_out_scale = nn.Parameter(torch.empty(-(-H // bn), cols // bk), requires_grad=False)
        self.w13_scale.fp8_scale = self.w_out_scale.fp8_scale = True  # fp32 whatever the model dtype

    def _fp8_specs(self, prefix: str) -> list[WeightSpec]:
        """w13, w_out and their scales from the raw FP8 pairs (the loader gives a spec that
        names a weight's scale the raw weight)."""
        E, I, H, S = self.num_experts, self.inter, self.hidden, self.shared_inter
        bn, bk = self.fp8_block
        mine = range(self.first, self.first + self.num_local)
        ex, sd = prefix + ".experts", f"{prefix}.shared_expert.down_proj.weight"
        gates = [f"{ex}.{e}.gate_proj.weight" for e in range(E)]
        ups = [f"{ex}.{e}.up_proj.weight" for e in range(E)]
        downs = [f"{ex}.{e}.down_proj.weight" for e in range(E)]
        sc = lambda n: n + "_scale_inv"  # noqa: E731
        s0, sl = self.shared_range
        gh, gi = -(-H // bk), I // bk
        w13_src = {n: (I, H) for n in gates + ups} | {sc(n): (I // bn, gh) for n in gates + ups}
        out_src = ({n: (H, I) for n in downs} | {sc(n): (-(-H // bn), gi) for n in downs}
                   | ({sd: (H, S), sc(sd): (-(-H // bn), S // bk)} if self.s else {}))

        def stack13(t, suffix):  # scales as fp32 (ue8m0 checkpoints store float8_e8m0fnu)
            w = torch.stack([torch.cat([read(t[gates[e] + suffix]), read(t[ups[e] + suffix])]) for e in mine])
            return w.float() if suffix else w

        def cat_out(t, suffix, div):
            shared = [narrow(t[sd + suffix], 1, s0 // div, sl // div)] if self.s else []
            w = torch.cat(shared + [read(t[downs[e] + suffix]) for e in mine], dim=1)
            return w.float() if suffix else w

        def export_unsupported(_):
            raise ValueError("export_state_dict of FP8-kept experts is not supported: load with keep_fp8=False")

        return [WeightSpec(self.w13, w13_src, lambda t: stack13(t, ""), export_unsupported, keep_dtype=True),
                WeightSpec(self.w13_scale, {n: w13_src[n] for n in w13_src if n.endswith("_scale_inv")},
                           lambda t: stack13(t, "_scale_inv"), export_unsupported, keep_dtype=True),
                WeightSpec(self.w_out, out_src, lambda t: cat_out(t, "", 1), export_unsupported, keep_dtype=True),
                WeightSpec(self.w_out_scale, {n: out_src[n] for n in out_src if n.endswith("_scale_inv")},
                           lambda t: cat_out(t, "_scale_inv", bk), export_unsupported, keep_dtype=True)]

    def _lin(self, x: Tensor, w: Tensor, scale: Tensor | None) -> Tensor:
        """x @ w^T, through the block-scaled FP8 matmul when the weight is kept in FP8. Plain
        Tensor: the linear family's shape-polymorphic helper (its callers are typed)."""
        return linear(x, w) if self.fp8_block is None else fp8_linear(x, w, scale, self.fp8_block)

    # ---- checkpoint layout ----------------------------------------------------------------
    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        E, I, H, S, s = self.num_experts, self.inter, self.hidden, self.shared_inter, self.s
        mine = range(self.first, self.first + self.num_local)
        ex, sh = prefix + ".experts", prefix + ".shared_expert"
        router, sgate = prefix + ".gate.weight", prefix + ".shared_expert_gate.weight"
        sg, su, sd = f"{sh}.gate_proj.weight", f"{sh}.up_proj.weight", f"{sh}.down_proj.weight"
        gates = [f"{ex}.{e}.gate_proj.weight" for e in range(E)]
        ups = [f"{ex}.{e}.up_proj.weight" for e in range(E)]
        downs = [f"{ex}.{e}.down_proj.weight" for e in range(E)]
        s0, sl = self.shared_range
        src_in = {router: (E, H)} | ({sgate: (1, H), sg: (S, H), su: (S, H)} if s else {})

        def assemble_in(t):
            shared = [read(t[sgate]), narrow(t[sg], 0, s0, sl), narrow(t[su], 0, s0, sl)] if s else []
            return torch.cat([read(t[router])] + shared)

        def export_in(w):
            if not s:
                return {router: w}
            return dict(zip([router, sgate, sg, su], w.split([E, 1, sl, sl])))

        def assemble_13(t):
            return torch.stack([torch.cat([read(t[gates[e]]), read(t[ups[e]])]) for e in mine])

        def export_13(w):
            out = {}
            for e, block in zip(mine, w):
                out[gates[e]], out[ups[e]] = block.split([I, I])
            return out

        def assemble_out(t):
            shared = [narrow(t[sd], 1, s0, sl)] if s else []
            return torch.cat(shared + [read(t[downs[e]]) for e in mine], dim=1)

        def export_out(w):
            keys = ([sd] if s else []) + [downs[e] for e in mine]
            return dict(zip(keys, w.split(([sl] if s else []) + [I] * self.num_local, dim=1)))

        if self.fp8_block is not None:
            return [WeightSpec(self.w_in, src_in, assemble_in, export_in)] + self._fp8_specs(prefix)
        return [WeightSpec(self.w_in, src_in, assemble_in, export_in),
                WeightSpec(self.w13, {n: (I, H) for n in gates + ups}, assemble_13, export_13),
                WeightSpec(self.w_out, {n: (H, I) for n in downs} | ({sd: (H, S)} if s else {}),
                           assemble_out, export_out)]

    # ---- forward ----------------------------------------------------------------------------
    def router_logits(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens experts"]:
        return linear(x, self.w_in[:self.num_experts])

    @checked
    def route(self, logits: Float[Tensor, "num_tokens experts"]) -> tuple[
            Float[Tensor, "num_tokens topk"], Int[Tensor, "num_tokens topk"]]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.topk, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if weights.dtype == logits.dtype else weights.to(logits.dtype)), experts

    # Above this many token-expert pairs a step loops over the experts hit (prefill, and
    # training, which sets it to 0); below it every path has fixed shapes, and each token's
    # result is independent of the other tokens in the batch (padded rows cannot change real
    # rows' rounding). Looping pays only for steps of many tokens.
    dense_limit: int = 1024
    # Gathering the chosen experts' blocks pays when they are a small share of the experts:
    # with few experts the dense path is faster even for one token; with hundreds of experts
    # a decode step reads a hundredth of the weights.
    sparse_share: int = 8
    # The experts' activation (Gemma 4's experts use gelu-tanh).
    act = staticmethod(F.silu)

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens hidden"]:
        return self._experts(x, linear(x, self.w_in))           # [T, E + s + 2S]

    def _experts(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
                 ) -> Float[Tensor, "num_tokens hidden"]:
        """The routed (and shared) experts on router outputs h, by the path that fits the step.
        A captured or traced graph must not take the grouped path: its shapes follow the routing
        (a CUDA capture would fail; a CPU trace would replay the routing it was traced with)."""
        capturing = torch.jit.is_tracing() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        T = x.shape[0]
        if not capturing and T * self.num_experts > self.dense_limit:
            out = self._grouped(x, h)
        elif T * self.topk * self.sparse_share <= self.num_local:
            out = self._sparse(x, h)
        else:
            out = self._dense(x, h)
        return self.tp.all_reduce(out)

    def _shared_act(self, h: Float[Tensor, "num_tokens _"]) -> Float[Tensor, "num_tokens _"]:
        """sigmoid(gate) * silu(g) * u of the shared expert, from w_in's output."""
        E, S = self.num_experts, self.shared_range[1]
        return F.silu(h[:, E + 1:E + 1 + S]) * h[:, E + 1 + S:] * torch.sigmoid(h[:, E:E + 1])

    def _local(self, experts: Int[Tensor, "num_tokens topk"], weights: Float[Tensor, "num_tokens topk"]
               ) -> tuple[Int[Tensor, "_"], Float[Tensor, "num_tokens topk"]]:
        """This rank's index of each chosen expert; another rank's expert gets a stand-in
        index and weight 0."""
        local = experts.flatten() - self.first
        if self.tp.size > 1:
            weights = weights * ((local >= 0) & (local < self.num_local)).view(weights.shape)
            local = local.clamp(0, self.num_local - 1)
        return local, weights

    def _dense(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
               ) -> Float[Tensor, "num_tokens hidden"]:
        T, E, nl, I = x.shape[0], self.num_experts, self.num_local, self.inter
        weights, experts = self.route(h[:, :E])
        gate = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter(1, experts, weights)
        s13 = None if self.fp8_block is None else self.w13_scale.view(-1, self.w13_scale.shape[-1])
        gu = self._lin(x, self.w13.view(nl * 2 * I, -1), s13).view(T, nl, 2, I)
        act = self.act(gu[:, :, 0]) * gu[:, :, 1] * gate[:, self.first:self.first + nl, None]   # [T, nl, I]
        act = act.reshape(T, nl * I)
        if self.s:
            act = torch.cat([self._shared_act(h), act], dim=1)
        return self._lin(act, self.w_out, getattr(self, "w_out_scale", None))

    def _sparse(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
                ) -> Float[Tensor, "num_tokens hidden"]:
        """Runs just the chosen experts (moe_experts.py: their blocks gathered, token-major,
        k per token, as batched matrix-vector products; or the backend's fused kernel)."""
        T, K, E, H, I, S = x.shape[0], self.topk, self.num_experts, self.hidden, self.inter, self.shared_range[1]
        weights, experts = self.route(h[:, :E])
        local, weights = self._local(experts, weights)
        # Expert e's down columns as an [I, H] block (contiguous when w_out is column-major).
        down = self.w_out[:, S:].T.view(self.num_local, I, H)
        if self.fp8_block is None and self.act is F.silu:   # the backend's experts (fused on Triton)
            run = self.ops.moe_experts if self.ops is not None else moe_experts
            out = run(x, self.w13, down, local.view(T, K), weights)
            return out + linear(self._shared_act(h), self.w_out[:, :S]) if self.s else out
        xs = x.repeat_interleave(K, dim=0)[:, :, None]                              # [T*K, H, 1]
        w13 = self.w13.index_select(0, local)
        down = down.index_select(0, local)
        shared_scale = None
        if self.fp8_block is not None:  # the chosen experts' blocks only, dequantized
            bn, bk = self.fp8_block
            w13 = dequantize(w13, self.w13_scale.index_select(0, local), self.fp8_block, x.dtype)
            ds = self.w_out_scale[:, S // bk:].T.view(self.num_local, I // bk, -1).index_select(0, local)
            down = dequantize(down, ds, (bk, bn), x.dtype)
            shared_scale = self.w_out_scale[:, :S // bk]
        g, u = torch.matmul(w13, xs).chunk(2, dim=1)                                 # [T*K, I, 1]
        act = self.act(g) * u * weights.reshape(T * K, 1, 1)
        out = torch.matmul(act.transpose(1, 2), down).view(T, K, H).sum(1)         # [T, H]
        return out + self._lin(self._shared_act(h), self.w_out[:, :S], shared_scale) if self.s else out

    def _grouped(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
                 ) -> Float[Tensor, "num_tokens hidden"]:
        E, I, S = self.num_experts, self.inter, self.shared_range[1]
        weights, experts = self.route(h[:, :E])
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        token_of = order // self.topk
        start = 0
        for e, c in enumerate(counts):
            idx, tok = order[start:start + c], token_of[start:start + c]
            start += c
            local = e - self.first
            if c == 0 or not 0 <= local < self.num_local:  # not routed here, or another rank's
                continue
            cols = slice(S + local * I, S + (local + 1) * I)
            s13 = sdown = None
            if self.fp8_block is not None:
                bk = self.fp8_block[1]
                s13, sdown = self.w13_scale[local], self.w_out_scale[:, cols.start // bk:cols.stop // bk]
            g, u = self._lin(x[tok], self.w13[local], s13).chunk(2, dim=-1)
            down = self.w_out[:, cols]
            out.index_add_(0, tok, self._lin(self.act(g) * u * weights.flatten()[idx, None], down, sdown))
        shared_scale = None if self.fp8_block is None else self.w_out_scale[:, :S // self.fp8_block[1]]
        return out + self._lin(self._shared_act(h), self.w_out[:, :S], shared_scale) if self.s else out


def fused_expert_aliases(shapes: dict, num_experts: int, intermediate: int) -> dict:
    """Checkpoints written with experts already fused (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) are read as if split per expert: per-expert name ->
    (fused name, how to cut it)."""
    aliases = {}
    for name in shapes:
        if name.endswith(".experts.gate_up_proj"):
            ex = name[: -len(".gate_up_proj")]
            for e in range(num_experts):
                aliases[f"{ex}.{e}.gate_proj.weight"] = (name, lambda t, e=e: t[e, :intermediate])
                aliases[f"{ex}.{e}.up_proj.weight"] = (name, lambda t, e=e: t[e, intermediate:])
        elif name.endswith(".experts.down_proj"):
            ex = name[: -len(".down_proj")]
            for e in range(num_experts):
                aliases[f"{ex}.{e}.down_proj.weight"] = (name, lambda t, e=e: t[e])
    return aliases
