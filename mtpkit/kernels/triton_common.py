"""What every Triton entry point decides first: run the kernel, or the torch reference."""

import os

import torch


def interpreting() -> bool:
    """TRITON_INTERPRET is read when a kernel module is imported (at @triton.jit time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def use_reference(module: str, *xs: torch.Tensor) -> bool:
    """fp64 goes to the torch reference (the kernels compute in fp32); a CPU tensor without
    the interpreter cannot run a kernel at all, which is a configuration error."""
    if any(x.dtype == torch.float64 for x in xs):
        return True
    if xs[0].device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the Triton kernels of {module} need CUDA tensors, or TRITON_INTERPRET=1 set "
                           f"before {module} is imported; use attn_backend='torch' on CPU")
    return False
