"""The one fallback rule of the Triton backend: what every Triton entry point decides first."""

import os

import torch


def interpreting() -> bool:
    """TRITON_INTERPRET is read when a kernel module is imported (at @triton.jit time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def use_reference(module: str, *xs: torch.Tensor) -> bool:
    """Whether a Triton entry point of `module` (its __name__) runs its torch reference instead
    of the kernel, for the input tensors `xs` (those whose dtype sets the arithmetic; the first
    one's device decides where it runs). The rule, the same for every entry point of the
    "triton" backend (kernels/ops.py's table), and the only way any of them reaches a reference:

    - any of `xs` in float64: the reference (the kernels compute in fp32; the fp64 tests ask
      for 1e-12 agreement);
    - a tensor not on CUDA while the interpreter is off: a configuration error (RuntimeError),
      never a silent fallback, since the torch backend is the way to run on CPU;
    - otherwise the kernel (on CUDA, or on CPU under TRITON_INTERPRET=1, as the tests run them).

    Choices inside the Triton backend among GPU kernels (flash-attn in triton_paged, fla-core
    in triton_gdn) are not fallbacks: they never run a torch reference."""
    if any(x.dtype == torch.float64 for x in xs):
        return True
    if xs[0].device.type != "cuda" and not interpreting():
        raise RuntimeError(f"the Triton kernels of {module} need CUDA tensors, or TRITON_INTERPRET=1 set "
                           f"before {module} is imported; use attn_backend='torch' on CPU")
    return False
