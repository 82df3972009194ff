"""How a parameter is made from checkpoint tensors, and back.

A `WeightSpec` ties one parameter to the checkpoint names it is built from: their full shapes
(checked before anything is read), `assemble` (full tensors -> this rank's parameter; the
tensors may be the loader's not-yet-read `Stored` ones, so a rank reads only its slices) and
`export` (a single-rank parameter -> checkpoint tensors, the inverse, used to write
checkpoints). Modules whose parameters merge several checkpoint tensors (one matmul instead
of several) describe themselves with these; the loader handles the rest.

What the loader calls is written down here, at the loader's own floor (it cannot import the
families): on a whole model, `CheckpointModel`; on its modules, `HasCheckpointSpecs` and
`KeepsFP8`.
"""

import dataclasses
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from mtpkit.parallel import TP


@dataclasses.dataclass
class WeightSpec:
    param: torch.nn.Parameter
    sources: dict[str, tuple[int, ...]]                   # checkpoint name -> expected full shape
    assemble: Callable[[dict], torch.Tensor]              # full (maybe unread) tensors -> param
    export: Callable[[torch.Tensor], dict[str, torch.Tensor]]  # param (one rank) -> tensors
    keep_dtype: bool = False   # loaded as stored (FP8 weights and their fp32 scales), not cast


@runtime_checkable
class CheckpointModel(Protocol):
    """A model the loader and the dummy weights fill (an nn.Module: they walk its
    named_modules / named_parameters / buffers). Every family model provides all of it;
    the optional hooks have their defaults in mtpkit.models.family.FamilyModel."""

    cfg: Any                                   # its config (the loader reads vocab_size)
    tp: TP
    embed_tokens: torch.nn.Parameter           # vocab-parallel
    lm_head: torch.nn.Parameter | None         # vocab-parallel; None when tied to embed_tokens

    def checkpoint_name(self, param_name: str) -> str:
        """The checkpoint's name of a parameter (or of a module's prefix)."""

    def checkpoint_aliases(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, Callable]]:
        """Other layouts of the same tensors it can read: expected name -> (stored name, cut)."""

    def ignored_checkpoint_prefixes(self) -> tuple[str, ...]:
        """Checkpoint tensors it leaves unread, by name prefix."""

    def dummy_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A random-weights start value for a parameter; None: the dummy weights' own rules."""

    def set_weight_layout(self, device: torch.device) -> None:
        """Lays the loaded weights out for `device` (values unchanged)."""


# The two module-level hooks stay structural (isinstance against these protocols): the
# modules that describe their own layout are the linear family, the MoE blocks and a few
# family modules, spread over layers/ and models/, which this floor cannot name; a common base
# class would have to live here and be inherited by nn.Modules that need nothing else of it.
@runtime_checkable
class HasCheckpointSpecs(Protocol):
    """A module whose parameters are built from checkpoint tensors in its own way (merged,
    sharded or FP8 layouts)."""

    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        """Its parameters' WeightSpecs; `prefix`: its checkpoint name."""


@runtime_checkable
class KeepsFP8(Protocol):
    """A module that can keep the checkpoint's FP8 weights and run the block-scaled matmul."""

    def use_fp8(self, block: tuple[int, int], prefix: str, fp8_names, ops=None) -> bool:
        """Switch to FP8 mode before loading, running the FP8 matmuls of `ops` (the model's
        kernel selector, kernels/ops.py); False: none of its weights is FP8."""


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
