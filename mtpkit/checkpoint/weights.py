"""How a parameter is made from checkpoint tensors, and back.

A `WeightSpec` ties one parameter to the checkpoint names it is built from: their full shapes
(checked before anything is read), `assemble` (full tensors -> this rank's parameter; the
tensors may be the loader's not-yet-read `Stored` ones, so a rank reads only its slices) and
`export` (a single-rank parameter -> checkpoint tensors, the inverse, used to write
checkpoints). Modules whose parameters merge several checkpoint tensors (one matmul instead
of several) describe themselves with these; the loader handles the rest.
"""

import dataclasses
from typing import Callable

import torch

from mtpkit.parallel import TP


@dataclasses.dataclass
class WeightSpec:
    param: torch.nn.Parameter
    sources: dict[str, tuple[int, ...]]                   # checkpoint name -> expected full shape
    assemble: Callable[[dict], torch.Tensor]              # full (maybe unread) tensors -> param
    export: Callable[[torch.Tensor], dict[str, torch.Tensor]]  # param (one rank) -> tensors
    keep_dtype: bool = False   # loaded as stored (FP8 weights and their fp32 scales), not cast


def read(x) -> torch.Tensor:
    """A checkpoint tensor, read if the loader has not read it yet."""
    return x.read() if hasattr(x, "read") else x


def shard_range(rows: int, block: int, tp: TP, what: str, replicate: bool = False) -> tuple[int, int]:
    """(start, length) of this rank's rows when `rows` are split across ranks in whole blocks
    of `block` rows. `replicate`: fewer blocks than ranks (that divide the ranks evenly) put
    block b on ranks b * size/blocks ... (b+1) * size/blocks - 1 instead of refusing."""
    blocks = rows // block
    if replicate and blocks < tp.size and tp.size % blocks == 0:
        return tp.rank // (tp.size // blocks) * block, block
    per = tp.split(blocks, what=what) * block
    return tp.rank * per, per


def narrow(x, dim: int, start: int, length: int) -> torch.Tensor:
    """A slice of a (maybe unread) checkpoint tensor; reads only that slice."""
    if start == 0 and length == x.shape[dim]:
        return read(x)
    return x.narrow(dim, start, length)


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (x[order][inverse(order)] == x). Load/export
    time only: a row index of a merged weight, which has no shapes.py dimension name."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return inv
