"""FP8 weights kept as stored (FP8 mode: CUDA by default, `LLM(keep_fp8=True)` anywhere), laid
out for the matmuls like the plain weights, never requantized.

A module's weight is made of rows of checkpoint tensors (`Part`s: a rank's rows of each
projection it merges, concatenated, then permuted by the module's `order`) and a range of
their input features (`Columns`: a row-parallel rank's shard, or all of them):

- Rows. When every block of block_n output rows lies in one stored block of one part (parts
  and shards of whole blocks, permutations that move whole blocks: Qwen3-Next's and Gemma 4's
  real widths), the scale table is those blocks' scale rows in output order, and row n uses
  scale row n // block_n: the checkpoint's block layout. Otherwise (a part or shard that cuts
  a block: Qwen3-Next's in_proj_ba, 64 rows; a shared expert split 8 ways; tiny test models)
  every row keeps the scale of the block it was stored in: the table holds each stored block
  used once, and `scale_rows` [N] names each row's. Both are one kernel launch; vLLM instead
  refuses block-quantized merges whose parts are not whole blocks, or splits them into
  separate layers.
- Columns. A shard of the input features that cuts a block (a shared expert's down
  projection split 8 ways) is stored widened to whole blocks, zero outside the shard, and the
  input is padded with zeros to match (`k_pad`), so each activation group lines up with one
  weight block (as serving engines pad weights for block-wise FP8).
- Kinds. A merged weight whose parts are partly unquantized (modules_to_not_convert: Qwen3-Next's
  router and shared-expert gate beside the shared expert's gate and up rows) is split into runs
  of rows of one kind (`FP8Rows.segments`): an FP8 run multiplies through the block-scaled
  matmul, a plain run as any linear layer, and the outputs are concatenated.

The matmuls are the `ops` the layer was switched to FP8 mode with (`use_fp8(..., ops)`, the
model's kernel selector): Ops.fp8_linear / fp8_batched, the Triton kernels on the "triton"
backend and their torch references (kernels/fp8_matmul.py) on the "torch" one; without ops
(unit tests) the references. This module never picks a kernel itself.

Every tensor here is the linear family's (any leading dims), so plain Tensor; the typed
boundaries are the matmuls in kernels/fp8_matmul.py and kernels/triton_fp8_matmul.py.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.checkpoint.weights import WeightSpec, narrow, read
from mtpkit.kernels import fp8_matmul
from mtpkit.kernels.fp8_matmul import FP8
from mtpkit.kernels.ops import Ops


@dataclasses.dataclass(frozen=True)
class Part:
    """Rows start .. start + length - 1 of the checkpoint tensor `name` (full_rows rows)."""
    name: str
    full_rows: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class Columns:
    """Input features start .. start + length - 1 of `full` (a row-parallel shard, or all)."""
    full: int
    start: int
    length: int

    def stored(self, bk: int) -> tuple[int, int]:
        """The stored column range: the shard widened to whole blocks of bk."""
        return self.start // bk * bk, min(self.full, -(-(self.start + self.length) // bk) * bk)

    def pad(self, bk: int) -> tuple[int, int]:
        """Zeros the input needs before and after the shard to span the stored columns."""
        a0, a1 = self.stored(bk)
        return self.start - a0, a1 - self.start - self.length


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where each output row comes from and which scale row it uses (CPU tensors, load time)."""
    part: torch.Tensor                # [N] index of the part holding row n
    row: torch.Tensor                 # [N] its row in that part's full tensor
    table: torch.Tensor               # [scale rows, 2]: (part, stored scale row) of each table row
    scale_rows: torch.Tensor | None   # [N] int32 table row of each row; None: n // block_n


def row_sources(parts: list[Part], order: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(part index, row in its full tensor) of every output row: the parts' rows
    concatenated, then permuted by `order` (the module's plain layout)."""
    part = torch.cat([torch.full((p.length,), i, dtype=torch.int64, device="cpu") for i, p in enumerate(parts)])
    row = torch.cat([torch.arange(p.start, p.start + p.length, device="cpu") for p in parts])
    if order is not None:
        order = order.to("cpu")
        part, row = part[order], row[order]
    return part, row


def row_layout(part: torch.Tensor, row: torch.Tensor, block_n: int) -> RowLayout:
    """The block layout when each block of block_n output rows lies in one stored block,
    else a table of the stored blocks used with each row's index into it."""
    key = part * (1 << 40) + row // block_n            # the stored block of each row
    n = key.numel()
    first = key[::block_n]
    if torch.equal(key, first.repeat_interleave(block_n)[:n]):
        return RowLayout(part, row, torch.stack([first >> 40, first % (1 << 40)], 1), None)
    table, index = torch.unique(key, return_inverse=True)
    return RowLayout(part, row, torch.stack([table >> 40, table % (1 << 40)], 1), index.to(torch.int32))


def _slice(t, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Rows then columns of a (maybe unread) checkpoint tensor, reading only that slice."""
    if rows != (0, t.shape[0]):
        t = narrow(t, 0, *rows)
    return narrow(t, 1, cols[0], cols[1] - cols[0])


def gather_rows(t: dict, parts: list[Part], part: torch.Tensor, row: torch.Tensor,
                cols: tuple[int, int]) -> torch.Tensor:
    """The output rows (columns cols[0] .. cols[1] - 1) from the checkpoint tensors `t`,
    reading each used part's rank rows once."""
    used = sorted(set(part.tolist()))
    pieces, base = [], torch.zeros(len(parts), dtype=torch.int64, device="cpu")
    offset = 0
    for i in used:
        p = parts[i]
        pieces.append(_slice(t[p.name], (p.start, p.length), cols))
        base[i] = offset - p.start
        offset += p.length
    rows = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return rows.index_select(0, base[part] + row)


def scale_name(name: str) -> str:
    return name + "_scale_inv"  # fp8.FP8Format.scale_name (kept here to avoid a cycle)


class FP8Matrix(nn.Module):
    """A kept FP8 weight, or a stack of them sharing one row layout (experts: `lead`):
    weight float8_e4m3fn [*lead, N, stored columns], weight_scale_inv fp32
    [*lead, scale rows, column groups], scale_rows [N] (None: the block layout), and the
    input's zero padding `k_pad`. Its matmuls are `ops`' (the torch references without)."""

    def __init__(self, layout: RowLayout, cols: Columns, block: tuple[int, int], lead: tuple[int, ...] = (),
                 ops: Ops | None = None):
        super().__init__()
        bn, bk = block
        a0, a1 = cols.stored(bk)
        self.block, self.cols, self.layout, self.k_pad = block, cols, layout, cols.pad(bk)
        self.ops = ops
        n = layout.part.numel()
        self.weight = nn.Parameter(torch.empty(*lead, n, a1 - a0, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(*lead, layout.table.shape[0], -(-a1 // bk) - a0 // bk),
                                             requires_grad=False)
        self.weight_scale_inv.fp8_scale = True  # fp32 whatever the model dtype (memory planning)
        self.register_buffer("scale_rows", layout.scale_rows, persistent=False)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, self.k_pad) if any(self.k_pad) else x

    @property
    def _kernels(self):
        """The matmuls: the selector's, or the torch references (same names)."""
        return self.ops or fp8_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T (a 2-D weight; any leading dims of x)."""
        return self._kernels.fp8_linear(self._input(x), self.weight, self.weight_scale_inv, self.block,
                                        self.scale_rows)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x @ W[e]^T for one weight of the stack."""
        return self._kernels.fp8_linear(self._input(x), self.weight[e], self.weight_scale_inv[e], self.block,
                                        self.scale_rows)

    def batched(self, x: torch.Tensor, experts: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [B, M, K] @ W[experts[b]]^T per b (W[b] without experts; x [1, M, K] is shared
        by every weight of the stack)."""
        return self._kernels.fp8_batched(self._input(x), self.weight, self.weight_scale_inv, self.block, experts,
                                         self.scale_rows, out_dtype)

    # ---- loading ------------------------------------------------------------------------
    def _read(self, t: dict, parts: list[Part]) -> torch.Tensor:
        a0, a1 = self.cols.stored(self.block[1])
        w = gather_rows(t, parts, self.layout.part, self.layout.row, (a0, a1))
        front, back = self.k_pad
        if not (front or back):
            return w
        out = torch.zeros(w.shape, dtype=w.dtype)  # zero outside this rank's shard
        out[:, front:w.shape[1] - back] = w[:, front:w.shape[1] - back]
        return out

    def _read_scales(self, t: dict, parts: list[Part]) -> torch.Tensor:
        bk = self.block[1]
        a0, a1 = self.cols.stored(bk)
        table = self.layout.table
        out = torch.empty(table.shape[0], -(-a1 // bk) - a0 // bk)
        for i in sorted(set(table[:, 0].tolist())):  # scales as fp32 (ue8m0: float8_e8m0fnu)
            s = read(t[scale_name(parts[i].name)]).float()[:, a0 // bk:-(-a1 // bk)]
            mine = table[:, 0] == i
            out[mine] = s[table[mine, 1]]
        return out

    def specs(self, parts_of: list[list[Part]], fused: tuple[int, int] | None = None,
              declared: list[list[Part]] | None = None) -> list[WeightSpec]:
        """The weight and its scales from the raw FP8 pairs: parts_of[i] the parts of stack
        entry i (one list for a 2-D weight). `fused` (first, experts): the parts name stacks
        [experts, rows, K] (fused experts), of which entry i reads expert first + i.
        `declared`: the parts of every entry of the whole stack, all ranks' (what the loader
        expects in the checkpoint; default parts_of)."""
        lead = self.weight.dim() == 3
        bn, bk = self.block
        used = sorted(set(self.layout.part.tolist()))
        sources, scales = {}, {}
        for parts in declared or parts_of:
            for p in (parts[i] for i in used):
                stack = () if fused is None else (fused[1],)
                sources[p.name] = (*stack, p.full_rows, self.cols.full)
                scales[scale_name(p.name)] = (*stack, -(-p.full_rows // bn), -(-self.cols.full // bk))

        def entries(t):  # the tensors each stack entry reads
            if fused is None:
                return [t] * len(parts_of)
            mine = {n: narrow(v, 0, fused[0], len(parts_of)) for n, v in t.items()}
            return [{n: v[i] for n, v in mine.items()} for i in range(len(parts_of))]

        def build(t, fn):
            out = [fn(v, parts) for v, parts in zip(entries(t), parts_of)]
            return torch.stack(out) if lead else out[0]

        # A spec that names a weight's scale gets the raw FP8 weight from the loader.
        return [WeightSpec(self.weight, sources | scales, lambda t: build(t, self._read), _no_export, keep_dtype=True),
                WeightSpec(self.weight_scale_inv, scales, lambda t: build(t, self._read_scales), _no_export,
                           keep_dtype=True)]


def _no_export(_):
    raise ValueError("export_state_dict of FP8-kept weights is not supported: load with keep_fp8=False")


class PlainRows(nn.Module):
    """A run of unquantized rows of a weight in FP8 mode (modules_to_not_convert)."""

    def __init__(self, part: torch.Tensor, row: torch.Tensor, cols: Columns):
        super().__init__()
        self.part, self.row, self.cols = part, row, cols
        self.weight = nn.Parameter(torch.empty(part.numel(), cols.length), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # as layers.linear (which imports this module)
        return torch.mm(x, w.t()) if x.dim() == 2 else F.linear(x, w)

    def specs(self, parts: list[Part]) -> list[WeightSpec]:
        c = self.cols
        used = sorted(set(self.part.tolist()))
        sources = {parts[i].name: (parts[i].full_rows, c.full) for i in used}
        return [WeightSpec(self.weight, sources,
                           lambda t: gather_rows(t, parts, self.part, self.row, (c.start, c.start + c.length)),
                           _no_export)]


class FP8Rows(nn.Module):
    """A weight in FP8 mode: its output rows as runs of one kind, FP8 (`FP8Matrix`) or plain
    (`PlainRows`), each computed on its own and concatenated (one run in the usual case).
    The FP8 runs' matmuls are `ops`' (the torch references without)."""

    def __init__(self, parts: list[Part], order: torch.Tensor | None, cols: Columns, block: tuple[int, int],
                 fp8_names, ops: Ops | None = None):
        super().__init__()
        self.parts = parts
        part, row = row_sources(parts, order)
        kind = torch.tensor([p.name in fp8_names for p in parts], device="cpu")[part]
        cuts = [0] + (torch.nonzero(kind[1:] != kind[:-1]).flatten() + 1).tolist() + [part.numel()]
        self.segments = nn.ModuleList(
            FP8Matrix(row_layout(part[a:b], row[a:b], block[0]), cols, block, ops=ops) if kind[a] else
            PlainRows(part[a:b], row[a:b], cols) for a, b in zip(cuts, cuts[1:]))

    @staticmethod
    def build(parts, order, cols, block, fp8_names, ops: Ops | None = None) -> "FP8Rows | None":
        """The FP8-mode layout, None when no part is FP8 in the checkpoint."""
        if not any(p.name in fp8_names for p in parts):
            return None
        return FP8Rows(parts, order, cols, block, fp8_names, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [s(x) for s in self.segments]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def specs(self) -> list[WeightSpec]:
        return [spec for s in self.segments for spec in (s.specs([self.parts]) if isinstance(s, FP8Matrix)
                                                          else s.specs(self.parts))]
