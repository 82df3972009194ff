"""The weights' memory layout on the device: one rule for every family (FamilyModel's
`set_weight_layout` calls it).

On CPU every matrix that only multiplies (x @ W^T) is stored column-major: BLAS's small-batch
products read W^T contiguously, which is faster at decode sizes. Values and shapes are
unchanged. The tensors a model names stay row-major (embedding tables, gathered by token id;
Qwen3-Next's conv taps, no matmul operand); the experts' [local, 2I, hidden] blocks are laid
out as their [local * 2I, hidden] matrix (what the dense MoE path multiplies), unless the
MoE block gathers its chosen experts at decode sizes (SparseMoE.row_major_params: a gather
of a column-major block is a strided copy, 2.5x slower than computing every expert, where a
row-major block is a contiguous one: benchmarks/moe_paths.py).
A module lists such parameters in `row_major_params()`; one that multiplies the same input by
several of its weights may then make them views of one matrix (`merge_for_cpu()`: SparseMoE's
router + shared expert rows and its experts, when every decode step computes every expert).
Other devices keep the layout as loaded.
"""

from typing import Callable

import torch
from torch import nn


def set_weight_layout(module: nn.Module, device: torch.device, row_major: Callable[[str], bool]) -> None:
    """Lay `module`'s parameters out for `device`; `row_major(name)`: a parameter that keeps
    its row-major layout."""
    if device.type != "cpu":
        return
    keep = {id(p) for m in module.modules() if hasattr(m, "row_major_params") for p in m.row_major_params()}
    for name, p in module.named_parameters():
        if row_major(name) or p.dim() < 2 or id(p) in keep:
            continue
        flat = p.data.reshape(-1, p.shape[-1])
        p.data = flat.t().contiguous().t().view(p.shape)
    for m in module.modules():   # modules whose weights become views of one merged matrix
        if hasattr(m, "merge_for_cpu"):
            m.merge_for_cpu()
