"""Specialise a traced CPU graph to the one shape it was traced for.

A CPU decode graph (graphs.captured) is traced for fixed input shapes, and replays only with
those shapes (CapturedSteps keys graphs by them). The trace still records every `x.shape[i]` a
module reads (to build a view, a slice bound, a gather index) as an `aten::size` op run on
every replay, and every `x[:, a:b]` as a slice per dimension, including full-range ones. At
decode sizes such bookkeeping ops cost about as much as the arithmetic, and they are a large
share of a traced decode graph's ops (benchmarks/graph_ablation.py counts them).

`specialize` folds each size query into the constant the trace recorded, propagates
constants, drops slices and views that return their input unchanged, and removes the dead and
duplicate ops left over. Every value keeps its shape and memory (a full-range slice or an
identity view is an alias of its input), so the graph computes exactly what it did.

Only valid for graphs whose shapes do not depend on data (true of every captured body: CUDA
graph capture needs the same).
"""

import contextlib
import threading

import torch

_Graph = torch._C.Graph
_Node = torch._C.Node


def _sizes(value) -> list[int] | None:
    """The complete sizes the trace recorded for a tensor value, or None."""
    t = value.type()
    if not isinstance(t, torch._C.TensorType):
        return None
    sizes = t.sizes()
    return None if sizes is None or any(s is None for s in sizes) else list(sizes)


def _constant(value):
    return value.toIValue() if value.node().kind() == "prim::Constant" else None


def _fold_sizes(graph: _Graph) -> int:
    folded = 0
    for node in list(graph.nodes()):
        if node.kind() != "aten::size":
            continue
        inputs = list(node.inputs())
        sizes = _sizes(inputs[0])
        if sizes is None:
            continue
        if len(inputs) == 1:
            value = sizes
        else:
            dim = _constant(inputs[1])
            if dim is None:
                continue
            value = sizes[dim]
        with graph.insert_point_guard(node):
            const = graph.insertConstant(value)
        node.output().replaceAllUsesWith(const)
        node.destroy()
        folded += 1
    return folded


def _is_identity(node: _Node) -> bool:
    """A slice over a whole dimension with step 1, or a view/reshape to the input's own shape."""
    kind = node.kind()
    if kind == "aten::slice":
        x, dim, start, end, step = node.inputs()
        sizes, d, s, e, st = _sizes(x), _constant(dim), _constant(start), _constant(end), _constant(step)
        return (sizes is not None and d is not None and e is not None and st == 1
                and s in (0, None) and e >= sizes[d])
    if kind in ("aten::view", "aten::reshape"):
        x, shape = node.inputs()
        sizes, target = _sizes(x), _constant(shape)
        return sizes is not None and isinstance(target, list) and target == sizes
    return False


def _drop_identities(graph: _Graph) -> int:
    dropped = 0
    for node in list(graph.nodes()):
        if _is_identity(node):
            node.output().replaceAllUsesWith(next(node.inputs()))
            node.destroy()
            dropped += 1
    return dropped


def specialize(graph: _Graph) -> int:
    """Fold `graph`'s shape bookkeeping in place (see the module docstring); returns how many
    ops were folded or dropped before the clean-up passes."""
    changed = _fold_sizes(graph)
    torch._C._jit_pass_constant_propagation(graph)
    changed += _drop_identities(graph)
    torch._C._jit_pass_dce(graph)
    torch._C._jit_pass_cse(graph)
    torch._C._jit_pass_constant_propagation(graph)
    torch._C._jit_pass_dce(graph)
    return changed


def specialized(fn, name: str):
    """A new TorchScript function running `fn`'s (a traced function's) graph, specialised, in a
    compilation unit of its own: freed with the function (see `private_compilation_unit`)."""
    graph = fn.graph.copy()
    specialize(graph)
    return torch._C.CompilationUnit().create_function(name, graph)


_CU_LOCK = threading.Lock()


@contextlib.contextmanager
def private_compilation_unit():
    """torch.jit.trace registers every traced function, with its constants (a trace folds each
    weight's transposed view into one), in TorchScript's process-wide compilation unit, which
    never lets go: every engine ever built would keep its graphs and weights alive (measured:
    34 MB per tiny-qwen3-next engine with traced graphs). While this is open, traces register
    in a unit of their own instead (torch reads `torch.jit._state._python_cu` when it
    registers), dropped with the functions."""
    import torch.jit._state as state
    with _CU_LOCK:
        saved = state._python_cu
        state._python_cu = torch._C.CompilationUnit()
        try:
            yield
        finally:
            state._python_cu = saved
