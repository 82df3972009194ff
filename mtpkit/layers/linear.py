"""The linear-layer family with tensor parallelism, and the vocabulary-parallel embedding / head.

All linear layers go through `Linear` and its parallel forms (column, merged column, row, KV
heads), so that tensor parallelism shards weights (and loads only its slices) in one place:
`shard_dim` says which weight dim is split; a row-parallel output is all-reduced (one
all-reduce each). The vocabulary-parallel embedding and lm_head are the two functions after
them. Projections of the same input are merged into one weight (one matmul): at decode batch
sizes every op costs a fixed overhead, so fewer, larger ops are what makes a step fast.
Each module that merges checkpoint tensors says how (`checkpoint_specs`, see mtpkit/checkpoint/weights.py).
For FP8 checkpoints kept in FP8 (`use_fp8`) the same modules describe their rows and columns
as checkpoint `Part`s and `Columns`, from which fp8_layout.py lays out the FP8 weight.

The linear family and the norms (norm.py) are shape-polymorphic (any leading dims, the feature dim
last: tokens x hidden, tokens x heads x head_dim, tokens*heads x v_dim), so their forward
takes plain Tensor; the layers that call them (attention, GDN, MoE, model forward) are the
typed boundaries. So are the callers of the collectives in parallel.py.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.checkpoint.weights import WeightSpec, inverse, narrow, read, shard_range
from mtpkit.kernels.ops import Ops
from mtpkit.layers.fp8_layout import Columns, FP8Rows, Part
from mtpkit.parallel import TP
from mtpkit.shapes import Float, Int, Tensor, checked


class Linear(nn.Module):
    """y = x W^T, W [out, in]. Replicated: every rank holds all of W. The family's forward
    takes any leading dims ([num_tokens, in], [rows, heads, in], ...), so its x is a plain
    Tensor; the modules that call it name the dims."""

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
        self.fp8 = None  # FP8 mode: the weight kept as the checkpoint's FP8 data and block scales

    def _part(self) -> tuple[int, int]:
        """(start, length) of this rank's slice of the sharded dim."""
        return shard_range(self.full_shape[self.shard_dim], self.block, self.tp, type(self).__name__,
                           self.replicate_blocks)

    def load_full(self, full) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor (or of a not-yet-read one: anything
        with .narrow reads only the slice)."""
        if self.shard_dim is None or self.tp.size == 1:
            return read(full)
        return narrow(full, self.shard_dim, *self._part()).contiguous()

    # ---- FP8 mode (layers/fp8_layout.py) ---------------------------------------------
    def fp8_parts(self, prefix: str) -> list[Part]:
        """This rank's rows of each checkpoint tensor, in the order the weight concatenates them."""
        start, length = self._part() if self.shard_dim == 0 else (0, self.full_shape[0])
        return [Part(prefix + ".weight", self.full_shape[0], start, length)]

    def fp8_columns(self) -> Columns:
        start, length = self._part() if self.shard_dim == 1 else (0, self.full_shape[1])
        return Columns(self.full_shape[1], start, length)

    order: Tensor | None = None  # a permutation of the concatenated rows (merged layouts)

    def use_fp8(self, block: tuple[int, int], prefix: str, fp8_names, ops: Ops | None = None) -> bool:
        """Keep the checkpoint's FP8 weights (those of `fp8_names`) with their block scales and
        run the block-scaled FP8 matmul of `ops` (the model's kernel selector; the torch
        reference without); called before loading. False: no part is FP8."""
        layout = FP8Rows.build(self.fp8_parts(prefix), self.order, self.fp8_columns(), block, fp8_names, ops)
        if layout is None:
            return False
        self.fp8, self.weight = layout, None
        return True

    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        if self.fp8 is not None:
            return self.fp8.specs()
        name = prefix + ".weight"
        return [WeightSpec(self.weight, {name: self.full_shape}, lambda t: self.load_full(t[name]),
                           lambda w: {name: w})]

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight) if self.fp8 is None else self.fp8(x)


class ColumnParallelLinear(Linear):
    """Output features split across ranks; output stays sharded (no communication)."""

    shard_dim = 0


class RowParallelLinear(Linear):
    """Input features split across ranks; partial outputs are summed (one all-reduce)."""

    shard_dim = 1

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(super().forward(x))


class KVParallelLinear(ColumnParallelLinear):
    """k_proj / v_proj: whole KV heads per rank. With fewer KV heads than ranks each head is
    replicated on size/kv consecutive ranks, which are exactly the ranks holding the query
    heads that attend to it (query heads are split evenly, in order)."""

    replicate_blocks = True

    def __init__(self, in_features: int, num_kv_heads: int, head_dim: int, tp: TP):
        super().__init__(in_features, num_kv_heads * head_dim, tp, block=head_dim)


class MergedColumnParallelLinear(Linear):
    """Several column-parallel projections of one input as one weight, computed by one matmul.

    `parts`: (checkpoint name relative to the parent module, out_features, block, replicate)
    each, sharded like a ColumnParallelLinear (KVParallelLinear with replicate). Rank r holds
    its shard of every part, concatenated in order; then, if `order` is given, row i of the
    weight is row order[i] of that concatenation: the layout the caller's forward reads."""

    def __init__(self, in_features: int, parts: list[tuple[str, int, int, bool]], tp: TP | None = None,
                 order: Tensor | None = None):
        # `order` is a permutation of this weight's rows, used only when loading and exporting
        # (a 1-D index over rows, for which shapes.py has no dimension name).
        nn.Module.__init__(self)
        self.tp, self.parts, self.order = tp or TP.single(), parts, order
        self.ranges = [shard_range(n, block, self.tp, name, rep) for name, n, block, rep in parts]
        self.sizes = [length for _, length in self.ranges]
        self.full_shape = (sum(n for _, n, _, _ in parts), in_features)
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features), requires_grad=False)
        self.fp8 = None

    def fp8_parts(self, prefix: str) -> list[Part]:
        parent = prefix.rpartition(".")[0]
        return [Part(f"{parent}.{name}.weight", n, start, length)
                for (name, n, _, _), (start, length) in zip(self.parts, self.ranges)]

    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        if self.fp8 is not None:
            return self.fp8.specs()
        parent = prefix.rpartition(".")[0]
        names = [f"{parent}.{name}.weight" for name, *_ in self.parts]
        sources = {n: (rows, self.full_shape[1]) for n, (_, rows, _, _) in zip(names, self.parts)}

        def assemble(t):
            w = torch.cat([narrow(t[n], 0, start, length) for n, (start, length) in zip(names, self.ranges)])
            return w if self.order is None else w[self.order]

        def export(w):
            w = w if self.order is None else w[inverse(self.order)]
            return dict(zip(names, w.split(self.sizes)))

        return [WeightSpec(self.weight, sources, assemble, export)]


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
    logits = linear(hidden, weight)
    return logits if tp.size == 1 else tp.all_gather(logits)[..., :vocab]


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w^T, as F.linear without a bias (any shape: the linear family's kernel). A 2-D x
    goes to torch.mm on w's transposed view: the same BLAS product with less dispatch than
    F.linear's (bit-identical; in a traced graph w.t() of a weight is folded to a constant)."""
    return torch.mm(x, w.t()) if x.dim() == 2 else F.linear(x, w)


