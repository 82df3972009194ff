"""The weights' memory layout on the device: one rule for every family (FamilyModel's
`set_weight_layout` calls it).

On CPU every matrix that only multiplies (x @ W^T) is stored column-major: BLAS's small-batch
products read W^T contiguously, which is faster at decode sizes. Values and shapes are
unchanged. The tensors a model names stay row-major (embedding tables, gathered by token id;
Qwen3-Next's conv taps, no matmul operand); the experts' [local, 2I, hidden] blocks are laid
out as their [local * 2I, hidden] matrix (what the dense MoE path multiplies). Other devices
keep the layout as loaded.
"""

from typing import Callable

import torch
from torch import nn


def set_weight_layout(module: nn.Module, device: torch.device, row_major: Callable[[str], bool]) -> None:
    """Lay `module`'s parameters out for `device`; `row_major(name)`: a parameter that keeps
    its row-major layout."""
    if device.type != "cpu":
        return
    for name, p in module.named_parameters():
        if row_major(name) or p.dim() < 2:
            continue
        flat = p.data.reshape(-1, p.shape[-1])
        p.data = flat.t().contiguous().t().view(p.shape)
