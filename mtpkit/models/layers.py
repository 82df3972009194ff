"""Building blocks shared by the models: the linear-layer family, norms, RoPE, MLP and MoE.

All linear layers go through `Linear` and its parallel forms (column, row, KV heads), so that
tensor parallelism shards weights (and loads only its slices) in one place: `shard_dim` says
which weight dim is split; a row-parallel output is all-reduced (one all-reduce each). The
vocabulary-parallel embedding and lm_head are the two functions after them.

The linear family and the norms are shape-polymorphic (any leading dims, the feature dim
last: tokens x hidden, tokens x heads x head_dim, tokens*heads x v_dim), so their forward
takes plain Tensor; the layers that call them (attention, GDN, MoE, model forward) are the
typed boundaries. So are the callers of the collectives in parallel.py.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import TP
from ..shapes import Float, Int, Tensor, checked


class Linear(nn.Module):
    """y = x W^T, W [out, in]. Replicated: every rank holds all of W."""

    shard_dim: int | None = None  # weight dim split across TP ranks (0: out, 1: in)
    replicate_blocks = False      # fewer blocks than ranks: replicate blocks instead of refusing

    def __init__(self, in_features: int, out_features: int, tp: TP | None = None, block: int = 1):
        """`block`: the sharded dim is split in whole blocks of this many rows (heads)."""
        super().__init__()
        self.tp, self.block = tp or TP.single(), block
        self.full_shape = (out_features, in_features)
        shape = list(self.full_shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] = self._part()[1]
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)

    def _part(self) -> tuple[int, int]:
        """(start, length) of this rank's slice of the sharded dim."""
        tp, blocks = self.tp, self.full_shape[self.shard_dim] // self.block
        if self.replicate_blocks and blocks < tp.size and tp.size % blocks == 0:
            # Block b lives on ranks b * size/blocks ... (b+1) * size/blocks - 1.
            return tp.rank // (tp.size // blocks) * self.block, self.block
        per = tp.split(blocks, what=type(self).__name__) * self.block
        return tp.rank * per, per

    def load_full(self, full):
        """This rank's part of a full checkpoint tensor (or of a not-yet-read one: anything
        with .narrow reads only the slice)."""
        if self.shard_dim is None or self.tp.size == 1:
            return full
        return full.narrow(self.shard_dim, *self._part()).contiguous()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(Linear):
    """Output features split across ranks; output stays sharded (no communication)."""

    shard_dim = 0


class RowParallelLinear(Linear):
    """Input features split across ranks; partial outputs are summed (one all-reduce)."""

    shard_dim = 1

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class KVParallelLinear(ColumnParallelLinear):
    """k_proj / v_proj: whole KV heads per rank. With fewer KV heads than ranks each head is
    replicated on size/kv consecutive ranks, which are exactly the ranks holding the query
    heads that attend to it (query heads are split evenly, in order)."""

    replicate_blocks = True

    def __init__(self, in_features: int, num_kv_heads: int, head_dim: int, tp: TP):
        super().__init__(in_features, num_kv_heads * head_dim, tp, block=head_dim)


@checked
def vocab_parallel_embedding(token_ids: Int[Tensor, "num_tokens"], weight: Float[Tensor, "vocab_shard hidden"],
                             tp: TP) -> Float[Tensor, "num_tokens hidden"]:
    """Rows of a vocab-sharded table (rank r holds ids r*part ...): each rank looks up the ids it
    holds, zeros elsewhere, one all-reduce (exact: one non-zero term per element)."""
    if tp.size == 1:
        return F.embedding(token_ids, weight)
    part = weight.shape[0]
    local = token_ids - tp.rank * part
    outside = (local < 0) | (local >= part)
    x = F.embedding(local.clamp(0, part - 1), weight).masked_fill(outside[:, None], 0.0)
    return tp.all_reduce(x)


@checked
def vocab_parallel_logits(hidden: Float[Tensor, "num_logits hidden"], weight: Float[Tensor, "vocab_shard hidden"],
                          tp: TP, vocab: int) -> Float[Tensor, "num_logits vocab"]:
    """Logits over a vocab-sharded head, gathered so every rank holds all of them (the sampler
    and the drafter then see identical values on every rank); padding columns dropped."""
    logits = F.linear(hidden, weight)
    return logits if tp.size == 1 else tp.all_gather(logits)[..., :vocab]


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of Qwen3-Next: y = norm(x) * (1 + w), in fp32, cast back at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        return F.rms_norm(xf, (xf.shape[-1],), self.weight.to(xf.dtype) + 1.0, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: rmsnorm(x) * w * silu(z), plain weight (initialised to 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        dtype = x.dtype
        xf = x.float() if dtype != torch.float64 else x
        y = self.weight * F.rms_norm(xf, (xf.shape[-1],), None, self.eps).to(dtype)
        zf = z.float() if dtype != torch.float64 else z
        return (y * F.silu(zf)).to(dtype)


class PartialRoPE(nn.Module):
    """rotate_half RoPE on the first rot_dim dims of each head; frequencies in fp32 as the
    reference computes them, so logits match it."""

    def __init__(self, head_dim: int, rot_dim: int, theta: float):
        super().__init__()
        self.rot_dim = rot_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @checked
    def forward(
        self,
        positions: Int[Tensor, "num_tokens"],
        q: Float[Tensor, "num_tokens heads head_dim"],
        k: Float[Tensor, "num_tokens kv_heads head_dim"],
    ) -> tuple[Float[Tensor, "num_tokens heads head_dim"], Float[Tensor, "num_tokens kv_heads head_dim"]]:
        freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: Float[Tensor, "num_tokens _ head_dim"], cos: Float[Tensor, "num_tokens 1 head_dim"],
                sin: Float[Tensor, "num_tokens 1 head_dim"]) -> Float[Tensor, "num_tokens _ head_dim"]:
        # the middle dim is heads for q and kv_heads for k: "_" leaves it unnamed
        r = self.rot_dim
        x_rot, x_pass = x[..., :r], x[..., r:]
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
        rotated = torch.cat((-x2, x1), dim=-1)
        return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


class MLP(nn.Module):
    """SwiGLU MLP (dense layers and the shared expert)."""

    def __init__(self, hidden: int, intermediate: int, tp: TP):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, tp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Router softmax over all experts in fp32, top-k, optional renormalisation; SwiGLU experts
    with fused weights (w13 = [gate; up] per expert, as transformers fuses them on load); a
    shared expert scaled by sigmoid(shared_expert_gate(x)). Output = routed + gated shared.

    Tensor parallelism shards the experts: rank r holds whole experts r*E/size ... and computes
    only their share of the routed sum (the router is replicated, so every rank routes alike);
    the shared expert is split like an MLP. One all-reduce sums routed + shared together.
    Whole experts (not slices of each) keep every expert's matmuls full-sized and let each
    rank read only its experts from the checkpoint."""

    def __init__(self, hidden: int, num_experts: int, topk: int, intermediate: int,
                 shared_intermediate: int, norm_topk: bool, tp: TP):
        super().__init__()
        self.tp, self.topk, self.norm_topk = tp, topk, norm_topk
        self.gate = Linear(hidden, num_experts, tp)
        self.num_local = tp.split(num_experts, what="num_experts")
        self.first = tp.rank * self.num_local  # global id of this rank's first expert
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * intermediate, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, intermediate), requires_grad=False)
        self.shared_expert = MLP(hidden, shared_intermediate, tp) if shared_intermediate > 0 else None
        self.shared_expert_gate = Linear(hidden, 1, tp) if shared_intermediate > 0 else None

    @checked
    def route(self, x: Float[Tensor, "num_tokens hidden"]) -> tuple[
            Float[Tensor, "num_tokens topk"], Int[Tensor, "num_tokens topk"]]:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.topk, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    # Below this many token-expert pairs a step computes every expert for every token (one
    # batched product, no data-dependent shapes): each token's result is then independent of
    # the other tokens in the batch (padded rows cannot change real rows' rounding) and the
    # step is capturable in a CUDA graph. Larger steps (prefill) loop over the experts hit.
    # Measured on CPU (hidden 256, 8 experts, top-2): dense is faster up to ~100 tokens.
    dense_limit: int = 1024

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens hidden"]:
        weights, experts = self.route(x)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if capturing or x.shape[0] * self.w13.shape[0] <= self.dense_limit:
            out = self._dense(x, weights, experts)
        else:
            out = self._grouped(x, weights, experts)
        if self.shared_expert is not None:
            # Partial (un-reduced) shared output: summed with the routed part in one all-reduce.
            s = self.shared_expert
            shared = F.linear(F.silu(s.gate_proj(x)) * s.up_proj(x), s.down_proj.weight)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(out)

    def _dense(self, x: Float[Tensor, "num_tokens hidden"], weights: Float[Tensor, "num_tokens topk"],
               experts: Int[Tensor, "num_tokens topk"]) -> Float[Tensor, "num_tokens hidden"]:
        E = self.gate.weight.shape[0]
        gate = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter(1, experts, weights)
        gate = gate[:, self.first:self.first + self.num_local]                # this rank's experts
        g, u = torch.matmul(x, self.w13.transpose(1, 2)).chunk(2, dim=-1)     # [E, T, I]
        y = torch.matmul(F.silu(g) * u, self.w2.transpose(1, 2))              # [E, T, H]
        return (y * gate.T[:, :, None]).sum(0)

    def _grouped(self, x: Float[Tensor, "num_tokens hidden"], weights: Float[Tensor, "num_tokens topk"],
                 experts: Int[Tensor, "num_tokens topk"]) -> Float[Tensor, "num_tokens hidden"]:
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate.weight.shape[0]).tolist()
        token_of = order // self.topk
        start = 0
        for e, n in enumerate(counts):
            idx, tok = order[start:start + n], token_of[start:start + n]
            start += n
            local = e - self.first
            if n == 0 or not 0 <= local < self.num_local:  # not routed here, or another rank's
                continue
            g, u = F.linear(x[tok], self.w13[local]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, self.w2[local]) * weights.flatten()[idx, None]
            out.index_add_(0, tok, y)
        return out
