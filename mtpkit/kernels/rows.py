"""Writing rows of a cache tensor in place: the one write every decode-step kernel makes into
the caches (K/V at their slots, recurrent states at their state slots).

`put_rows_(dst, index, src)` is dst[index[i]] = src[i] along dim 0. Eager and in a TorchScript
trace it is `index_copy_`. In a compiled graph (LLM(compile=...)) it is `index_put_`: the cache
is an argument the graph mutates, and inductor turns the functional form of index_put back into
an in-place write, where index_copy has no in-place lowering and would copy the whole cache
tensor (every block of the pool, K and V, every layer) at every step and back again.
"""

import torch

from mtpkit.shapes import Int, Tensor


def put_rows_(dst: Tensor, index: Int[Tensor, "rows"], src: Tensor) -> Tensor:
    """dst[index[i]] = src[i] (dim 0, in place); returns dst."""
    if torch.compiler.is_compiling():
        return dst.index_put_((index,), src)
    return dst.index_copy_(0, index, src)
