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
their blocks (`_sparse`: a decode step reads k experts, not all of them; with a fused backend
kernel, which reads each touched expert once, every captured step does); a small step computes
every expert (`_dense`: three matmuls); a large step (prefill, training) loops over the experts
hit (`_grouped`, which reads the routing on the host).

Tensor parallelism shards the experts: rank r holds whole experts r*E/size ... and computes
only their share of the routed sum (the router is replicated, so every rank routes alike);
the shared expert is split like an MLP. One all-reduce sums routed + shared together.
Whole experts (not slices of each) keep every expert's matmuls full-sized and let each rank
read only its experts from the checkpoint.

FP8 checkpoints kept in FP8 (use_fp8): w_in's rows as runs of one kind (fp8_layout.FP8Rows:
the router is usually unquantized, the shared expert's gate and up rows FP8) and, when every
expert is FP8, the experts as moe_fp8.FP8Experts (their own stacks and paths) instead of w13
and w_out.

Every kernel comes from `ops` (kernels/ops.py: the experts, the gated activations, the FP8
matmuls); a block built without ops runs the torch references.
"""

import itertools

import torch
from torch import nn

from mtpkit.checkpoint.weights import WeightSpec, narrow, read, shard_range
from mtpkit.kernels import elementwise
from mtpkit.kernels.moe_experts import moe_experts
from mtpkit.kernels.ops import Ops
from mtpkit.layers.fp8_layout import Columns, FP8Rows
from mtpkit.layers.linear import linear
from mtpkit.layers.moe_fp8 import FP8Experts, MoENames, in_parts
from mtpkit.parallel import TP
from mtpkit.shapes import Float, Int, Tensor, checked


def top_k_by_argmax(probs: Float[Tensor, "num_tokens experts"], k: int) -> tuple[
        Float[Tensor, "num_tokens topk"], Int[Tensor, "num_tokens topk"]]:
    """torch.topk(probs, k) (largest first) as k argmax passes, in a compiled graph: inductor fuses
    them with the softmax into one C++ loop, where topk is an extern call that costs more than a
    few tokens' routing (docs/performance.md, "Inside the aot-tuned graphs"). The same values and
    experts (ties, which topk orders as it likes, resolved to the lower expert)."""
    values, indices = [], []
    for _ in range(k):
        i = probs.argmax(-1, keepdim=True)
        values.append(probs.gather(-1, i))
        indices.append(i)
        probs = probs.scatter(-1, i, float("-inf"))
    return torch.cat(values, -1), torch.cat(indices, -1)


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, topk: int, intermediate: int,
                 shared_intermediate: int, norm_topk: bool, tp: TP, ops: Ops | None = None):
        super().__init__()
        self.tp, self.topk, self.norm_topk = tp, topk, norm_topk
        # The kernels (kernels/ops.py): moe_experts runs the sparse path's experts (the torch
        # reference without ops, or a fused Triton kernel), act_mul the shared expert's
        # activation, fp8_* the FP8 mode's matmuls.
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
        self.fp8_in = self.fp8 = None  # FP8 mode: w_in's rows; the experts (use_fp8)

    # ---- FP8 mode (moe_fp8.py): the checkpoint's FP8 weights kept with their block scales --
    def moe_names(self, prefix: str, fp8_names) -> MoENames:
        """Qwen3-Next's checkpoint names (experts one by one, or fused when the checkpoint
        stores experts.gate_up_proj)."""
        return MoENames(router=prefix + ".gate.weight", experts=prefix + ".experts",
                        fused=f"{prefix}.experts.gate_up_proj" in fp8_names,
                        shared=prefix + ".shared_expert" if self.s else None,
                        shared_gate=prefix + ".shared_expert_gate.weight" if self.s else None)

    def use_fp8(self, block: tuple[int, int], prefix: str, fp8_names, ops: Ops | None = None) -> bool:
        """Keep the FP8 weights of `fp8_names`: w_in's rows (router, shared gate, shared gate
        and up: runs of one kind, see fp8_layout.FP8Rows) and, when every expert is FP8, the
        experts and the shared expert's down projection (moe_fp8.FP8Experts). Their matmuls
        are `ops`' (default the block's own). Called before loading; False when nothing is FP8."""
        names = self.moe_names(prefix, fp8_names)
        ops = self.ops if ops is None else ops
        self.fp8_in = FP8Rows.build(in_parts(self, names), None, Columns(self.hidden, 0, self.hidden), block,
                                    fp8_names, ops)
        self.fp8 = FP8Experts.build(self, names, block, fp8_names, ops)
        if self.fp8_in is not None:
            self.w_in = None
        if self.fp8 is not None:
            self.w13 = self.w_out = None
        return self.fp8_in is not None or self.fp8 is not None

    def project_in(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens _"]:
        """w_in's output: router logits, then the shared expert's gate, gate and up rows."""
        return linear(x, self.w_in) if self.fp8_in is None else self.fp8_in(x)

    # ---- checkpoint layout ----------------------------------------------------------------
    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        """The plain layout's specs, those of the weights kept in FP8 instead where they are."""
        plain = [spec for spec in self.plain_specs(prefix) if spec.param is not None]
        return plain + [spec for m in (self.fp8_in, self.fp8) if m is not None for spec in m.specs()]

    def plain_specs(self, prefix: str) -> list[WeightSpec]:
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

        return [WeightSpec(self.w_in, src_in, assemble_in, export_in),
                WeightSpec(self.w13, {n: (I, H) for n in gates + ups}, assemble_13, export_13),
                WeightSpec(self.w_out, {n: (H, I) for n in downs} | ({sd: (H, S)} if s else {}),
                           assemble_out, export_out)]

    # ---- forward ----------------------------------------------------------------------------
    def router_logits(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens experts"]:
        if self.fp8_in is not None:
            return self.fp8_in(x)[:, :self.num_experts]
        return linear(x, self.w_in[:self.num_experts])

    @checked
    def route(self, logits: Float[Tensor, "num_tokens experts"]) -> tuple[
            Float[Tensor, "num_tokens topk"], Int[Tensor, "num_tokens topk"]]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = (top_k_by_argmax(probs, self.topk) if torch.compiler.is_compiling()
                            else torch.topk(probs, self.topk, dim=-1))
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if weights.dtype == logits.dtype else weights.to(logits.dtype)), experts

    # Above this many token-expert pairs a step loops over the experts hit (prefill, and
    # training, which sets it to 0); below it every path has fixed shapes, and each token's
    # result is independent of the other tokens in the batch (padded rows cannot change real
    # rows' rounding). Looping pays only for steps of many tokens.
    dense_limit: int = 1024
    # With few experts, a step of many tokens gives each expert enough rows that looping over
    # them (two matmuls per expert on its gathered rows) beats computing every expert: from
    # this many pairs per expert on average (benchmarks/moe_paths.py --grouped).
    grouped_rows: int = 16
    # Gathering the chosen experts' blocks pays when they are a small share of the experts:
    # with few experts the dense path is faster even for one token; with hundreds of experts
    # a decode step reads a hundredth of the weights.
    sparse_share: int = 8
    # In a compiled graph (LLM(compile=...)) the gathered experts' products are fused C++ loops
    # (kernels/moe_experts.py), not BLAS calls on copied blocks, so the sparse path pays once its
    # pairs touch at most half the experts: a one-token pass at top 2 of 8 reads a quarter of the
    # expert weights, which a memory-bound decode step is paid for (docs/performance.md).
    compiled_sparse_share: int = 2
    # The experts' activation, by name (elementwise.ACTIVATIONS; Gemma 4's experts use
    # gelu_tanh): the fused kernel takes the name, the torch paths `activation`.
    act: str = "silu"

    def decode_gathers(self) -> bool:
        """Whether a one-token step takes the sparse path (gathers its experts' blocks)."""
        return (self.ops is not None and self.ops.fused_moe) or self.topk * self.sparse_share <= self.num_local

    def row_major_params(self) -> tuple:
        """Parameters to keep row-major on CPU (layers/layout.py): w13 when decode steps gather
        experts from it (each expert's [2I, hidden] block then one contiguous run); otherwise
        every step multiplies all of w13 at once, which the column-major matrix does faster."""
        return (self.w13,) if self.w13 is not None and self.decode_gathers() else ()

    @property
    def activation(self):
        return elementwise.ACTIVATIONS[self.act]

    # ---- CPU: w_in and w13 as one matrix (layers/layout.py) -------------------------------
    w_in13: Tensor | None = None   # [w_in rows | w13's rows], column-major; w_in and w13 are views of it
    merge_inputs = True            # whether w_in's input is x (Gemma 4's router reads another input)

    def merge_for_cpu(self) -> None:
        """When every decode step computes every expert (the dense path), w_in and w13 become
        views of one column-major matrix, so a dense step's two products of x are one matmul.
        Called by layout.set_weight_layout after the layouts are set."""
        if not self.merge_inputs or self.w_in is None or self.w13 is None or self.decode_gathers():
            return
        n = self.w_in.shape[0]
        merged = torch.cat([self.w_in.data, self.w13.data.reshape(-1, self.hidden)]).t().contiguous().t()
        self.w_in.data, self.w13.data = merged[:n], merged[n:].view(self.w13.shape)
        self.w_in13 = merged

    _merged_seen = False   # the last eager answer of _merged

    def _merged(self) -> bool:
        """w_in13 still holds w_in and w13 (not replaced since merge_for_cpu). Under torch.compile
        (which cannot compare pointers) the last eager answer: the trace a compiled graph replaces
        ran it, and a trace freezes it the same way."""
        if torch.compiler.is_compiling():
            return self._merged_seen
        m = self.w_in13
        self._merged_seen = (m is not None and self.w_in is not None and self.w13 is not None
                             and self.w_in.data_ptr() == m.data_ptr()
                             and self.w13.data_ptr() == m[self.w_in.shape[0]:].data_ptr())
        return self._merged_seen

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens hidden"]:
        if self._path(x.shape[0]) == "dense" and self._merged():
            n = self.w_in.shape[0]
            hg = linear(x, self.w_in13)                        # [T, E + s + 2S | experts' gate and up]
            return self.tp.all_reduce(self._dense(x, hg[:, :n], hg[:, n:]))
        return self._experts(x, self.project_in(x))           # [T, E + s + 2S]

    def _path(self, T: int) -> str:
        """The path a step of T tokens takes (by its shape, never its data). A captured or
        traced graph must not take the grouped path: its shapes follow the routing (a CUDA
        capture would fail; a CPU trace would replay the routing it was traced with)."""
        capturing = torch.jit.is_tracing() or torch.compiler.is_compiling() or (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        # A fused backend kernel reads each touched expert once however many tokens chose it,
        # so gathering beats computing every expert at any step size (a batch of 8 bundles of 4
        # with top 10 of 512 experts touches about half of them); the torch gather copies each
        # pair's expert, which pays only when the pairs are few against the experts.
        fused = self.fp8 is None and self.ops is not None and self.ops.fused_moe
        if not capturing and T * self.num_experts > self.dense_limit:
            return "grouped"
        if not capturing and not fused and T * self.topk >= self.grouped_rows * self.num_experts:
            return "grouped"   # (measured on CPU; a fused kernel reads each expert once anyway)
        share = self.compiled_sparse_share if torch.compiler.is_compiling() else self.sparse_share
        if fused or T * self.topk * share <= self.num_local:
            return "sparse"
        return "dense"

    def _experts(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
                 ) -> Float[Tensor, "num_tokens hidden"]:
        """The routed (and shared) experts on router outputs h, by the path that fits the step."""
        path, fp8 = self._path(x.shape[0]), self.fp8
        if path == "grouped":
            out = self._grouped(x, h) if fp8 is None else fp8.grouped(self, x, h)
        elif path == "sparse":
            out = self._sparse(x, h) if fp8 is None else fp8.sparse(self, x, h)
        else:
            out = self._dense(x, h) if fp8 is None else fp8.dense(self, x, h)
        return self.tp.all_reduce(out)

    def _shared_act(self, h: Float[Tensor, "num_tokens _"]) -> Float[Tensor, "num_tokens _"]:
        """sigmoid(gate) * silu(g) * u of the shared expert, from w_in's output."""
        E, S = self.num_experts, self.shared_range[1]
        return (self.ops or elementwise).act_mul(h[:, E + 1:E + 1 + S], h[:, E + 1 + S:], "silu", h[:, E:E + 1])

    def _local(self, experts: Int[Tensor, "num_tokens topk"], weights: Float[Tensor, "num_tokens topk"]
               ) -> tuple[Int[Tensor, "_"], Float[Tensor, "num_tokens topk"]]:
        """This rank's index of each chosen expert; another rank's expert gets a stand-in
        index and weight 0."""
        local = experts.flatten() - self.first
        if self.tp.size > 1:
            weights = weights * ((local >= 0) & (local < self.num_local)).view(weights.shape)
            local = local.clamp(0, self.num_local - 1)
        return local, weights

    def _dense(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"],
               gu: Float[Tensor, "num_tokens _"] | None = None) -> Float[Tensor, "num_tokens hidden"]:
        """`gu`: x's product with w13 when the caller has it (the merged matmul of forward)."""
        T, E, nl, I = x.shape[0], self.num_experts, self.num_local, self.inter
        weights, experts = self.route(h[:, :E])
        gate = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter(1, experts, weights)
        gu = (linear(x, self.w13.view(nl * 2 * I, -1)) if gu is None else gu).view(T, nl, 2, I)
        act = self.activation(gu[:, :, 0]) * gu[:, :, 1] * gate[:, self.first:self.first + nl, None]   # [T, nl, I]
        act = act.reshape(T, nl * I)
        if self.s:
            act = torch.cat([self._shared_act(h), act], dim=1)
        return linear(act, self.w_out)

    def _sparse(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
                ) -> Float[Tensor, "num_tokens hidden"]:
        """Runs just the chosen experts (moe_experts.py: their blocks gathered, token-major,
        k per token, as batched matrix-vector products; or the backend's fused kernel)."""
        T, K, E, H, I, S = x.shape[0], self.topk, self.num_experts, self.hidden, self.inter, self.shared_range[1]
        weights, experts = self.route(h[:, :E])
        local, weights = self._local(experts, weights)
        # Expert e's down columns as an [I, H] block (contiguous when w_out is column-major).
        down = self.w_out[:, S:].T.view(self.num_local, I, H)
        run = self.ops.moe_experts if self.ops is not None else moe_experts   # fused on Triton
        out = run(x, self.w13, down, local.view(T, K), weights, self.act)
        return out + linear(self._shared_act(h), self.w_out[:, :S]) if self.s else out

    def _grouped(self, x: Float[Tensor, "num_tokens hidden"], h: Float[Tensor, "num_tokens _"]
                 ) -> Float[Tensor, "num_tokens hidden"]:
        """The pairs sorted by expert and their tokens' rows gathered once, so each expert hit
        costs two matmuls on a contiguous run of rows (no per-expert index ops), and the gated
        activation and the routing weights are one op each over every pair."""
        E, I, S, K, nl = self.num_experts, self.inter, self.shared_range[1], self.topk, self.num_local
        weights, experts = self.route(h[:, :E])
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)                      # pairs, expert by expert
        counts = torch.bincount(flat, minlength=E).tolist()
        lo = sum(counts[:self.first])                                 # this rank's experts' pairs
        mine = counts[self.first:self.first + nl]
        pairs = order[lo:lo + sum(mine)]
        tok = pairs // K
        xs = x.index_select(0, tok)                                   # [pairs, H]
        bounds = [0, *itertools.accumulate(mine)]                      # expert e's run of pairs
        hit = [e for e in range(nl) if mine[e]]
        out = torch.zeros_like(x)
        if hit:   # (products concatenated, not written into slices with out=: training runs
            # this path under autograd, which refuses out= arguments)
            gu = torch.cat([xs[bounds[e]:bounds[e + 1]] @ self.w13[e].T for e in hit])
            act = self.activation(gu[:, :I]) * gu[:, I:] * weights.flatten().index_select(0, pairs)[:, None]
            ys = torch.cat([act[bounds[e]:bounds[e + 1]] @ self.w_out[:, S + e * I:S + (e + 1) * I].T for e in hit])
            out = out.index_add(0, tok, ys)
        return out + linear(self._shared_act(h), self.w_out[:, :S]) if self.s else out


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
