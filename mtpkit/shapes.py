"""The single vocabulary of dimension names, the `checked` decorator, the debug switch and
the shape trace.

Every tensor that crosses a boundary (metadata builders, attention / GDN / conv entry points,
model forward, sampler, proposer, cache allocators) is annotated with jaxtyping types whose
dimension names come from `DIMS` below. `checked` refuses, at import time, an annotation
that uses a name outside this vocabulary, so the names cannot drift.

Checking (jaxtyping + beartype) runs only in debug mode: `MTPKIT_DEBUG=1` in the environment,
or `with mtpkit.debug() as trace:` (works in a notebook). Off, a checked function costs one
attribute read and a branch. In debug mode each checked call is appended to the active
`ShapeTrace` with its bound dimension values, argument shapes and dtypes.

Note: no `from __future__ import annotations` here or in checked modules: jaxtyping needs
the real annotation objects.
"""

import collections
import contextlib
import dataclasses
import functools
import inspect
import os
import typing

import torch
from beartype import beartype
from beartype.roar import BeartypeException
from jaxtyping import AbstractArray, Bool, Float, Int, Shaped, TypeCheckError, jaxtyped

from mtpkit.display import HTMLRepr, render_html

Tensor = torch.Tensor

__all__ = [
    "DIMS", "Tensor", "Float", "Int", "Bool", "Shaped", "checked", "shaped_dataclass",
    "debug", "is_debug", "set_debug", "shape_trace", "ShapeTrace", "ShapeError",
]

# name -> meaning. The only dimension names an annotation may use.
DIMS: dict[str, str] = {
    # batch structure of one step
    "num_reqs": "real requests in a step",
    "num_reqs_padded": "requests a verify step is padded to (a captured graph size)",
    "draft_rows": "rows a drafter proposes for: every row of a verify step (its num_reqs_padded), or the prompts "
                  "a prefill step finished (padded to a graph size when that proposal is traced)",
    "num_spec": "draft tokens proposed per request per step (k)",
    "bundle": "tokens a request feeds the target in one verify step: num_spec + 1",
    "outcome": "a verify step's greedy outcome per row (sampling/rejection.greedy_verify): bundle tokens, "
               "num_emitted, bundle finite flags: 2 * bundle + 1",
    "live_outcome": "a step's outcome with a live flag per bundle position (sampling/rejection.sampled_verify, "
                    "controlled_greedy_verify): outcome's columns, then bundle flags, 1 where the processed logits "
                    "leave some token: 3 * bundle + 1",
    "decode_steps": "decode steps of a run (EngineConfig.num_scheduler_steps): rows of its outcome history",
    "num_tokens": "query tokens in a step (prefill: ragged sum; verify: num_reqs_padded*bundle)",
    "num_logits": "positions whose logits are computed in a step",
    "seq_len": "tokens of one sequence (score, prompts)",
    "ctx_len": "context length attended over (cached prefix + new tokens)",
    "num_queries": "query tokens of one attention call: every token of the step, or one per request",
    "q_len": "query tokens per row of a uniform step or attention call: the bundle in a verify step, "
             "1 in a drafter's one-token pass, a padded chunk's tokens in a captured prefill",
    "row_slots": "recurrent-state slots of one row of a uniform step: its bundle slots (verify, a captured "
                 "prefill's chunk), 1 in a drafter's one-token pass (unread there)",
    # model widths
    "hidden": "model hidden size",
    "vocab": "vocabulary size",
    "vocab_shard": "rows of a vocab-parallel embedding / lm_head held by one rank",
    "intermediate": "MLP / expert intermediate size",
    "gated_dim": "features of a gated activation act(g) * u: an MLP's intermediate size, or a gated attention "
                 "output's heads x head_dim",
    "heads": "query heads of full attention",
    "kv_heads": "key/value heads of full attention",
    "qk_heads": "query heads then key heads of full attention, normalised and rotated together",
    "head_dim": "head dimension of full attention",
    "rot_dim": "rotated dims of partial RoPE",
    "k_heads": "GDN key heads (HK)",
    "v_heads": "GDN value heads (HV)",
    "k_dim": "GDN key head dim (dk)",
    "v_dim": "GDN value head dim (dv)",
    "conv_dim": "GDN conv channels: 2*HK*dk + HV*dv",
    "conv_width": "GDN conv kernel width (W)",
    "conv_state_len": "conv state columns kept per slot: W - 1 + num_spec",
    "experts": "routed experts",
    "topk": "experts chosen per token",
    "in_features": "input features of a linear layer (the reduced dim of x @ W^T)",
    "out_features": "output features of a linear layer",
    "in_groups": "block-scaled FP8: scale groups along in_features, ceil(in_features / block_k)",
    "out_groups": "block-scaled FP8: rows of a weight's scale table: ceil(out_features / block_n) in the "
                  "block layout; a merged weight whose parts are not whole blocks names each row's (scale_rows)",
    "matmuls": "block-scaled FP8: independent products of one batched matmul (experts, or token-expert pairs)",
    "num_rows": "block-scaled FP8: activation rows of one product of a batched matmul (tokens; 1 for a "
                "token-expert pair)",
    "layers": "decoder layers of the model (Gemma 4's per-layer inputs, one slice per layer)",
    "ple_dim": "Gemma 4 per-layer embedding width (hidden_size_per_layer_input)",
    "backbone_hidden": "hidden size of the target a drafter reads (the Gemma 4 assistant's backbone_hidden_size)",
    "centroids": "token clusters of the Gemma 4 assistant's ordered-embedding head (num_centroids)",
    "num_constrained": "requests of a step with structured outputs (the rows a token bitmask covers)",
    "vocab_words": "int32 words of a token bitmask: ceil(vocab / 32), bit t % 32 of word t // 32 for token t",
    "num_logprobs": "top tokens returned with each position's logprobs (SamplingParams.logprobs, prompt_logprobs)",
    "candidates": "tokens the Gemma 4 assistant's centroid head scores: top-k clusters x vocab / num_centroids",
    # cache geometry
    "num_blocks": "paged-KV blocks in the pool (block 0 is the null block)",
    "block_size": "tokens per KV block",
    "max_blocks": "block-table width: blocks a request may hold",
    "kv_pools": "KV block pools (engine.kv_pools: full attention, one per sliding window): one block "
                "table and slot mapping each",
    "num_slots": "recurrent-state slots in the pool (slot 0 is the null slot)",
    "control_slots": "rows of the generation controls' tables (sampling/controls.py): one per running request "
                     "that uses a control, slot 0 the neutral row of every other row",
    "num_layers": "layers of one cache group in the model",
    "num_snapshots": "recurrent-state snapshots one step writes or one copy moves (step.metadata.StateSnapshots)",
    "snapshot_slots": "rows of the state-snapshot store (CacheTensors.snapshots), one snapshot id each",
}

# ---------------------------------------------------------------------------------------
# debug switch and trace


class ShapeError(HTMLRepr, TypeError):
    """A tensor at a boundary does not have the shape or dtype its annotation names.

    `boundary` is the checked function (or dataclass), `bindings` the dimension values bound
    before the conflict, `argument` the parameter (or "return") that conflicted, `actual` /
    `expected` its value and annotation as jaxtyping wrote them."""

    def __init__(self, message: str, boundary: str = "", bindings: dict[str, int] | None = None,
                 argument: str | None = None, actual: str | None = None, expected: str | None = None):
        super().__init__(message)
        self.boundary, self.bindings, self.argument = boundary, dict(bindings or {}), argument
        self.actual, self.expected = actual, expected

    html_kind = "shape_error"   # Jupyter: the boundary, the bindings, the argument


@dataclasses.dataclass
class TraceEntry:
    function: str
    dims: dict[str, int]
    args: dict[str, str]  # name -> "shape dtype"

    def __str__(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims.items())
        return f"{self.function}  [{dims}]"


class ShapeTrace:
    """Checked calls in debug mode, newest last (bounded, so long runs do not grow)."""

    def __init__(self, maxlen: int = 20000):
        self.entries: collections.deque[TraceEntry] = collections.deque(maxlen=maxlen)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def clear(self) -> None:
        self.entries.clear()

    def functions(self) -> list[str]:
        return [e.function for e in self.entries]

    def filter(self, function: str | None = None, **dims: int | bool) -> "ShapeTrace":
        """The entries whose function name contains `function` and whose bound dimensions
        match `dims` (a value: bound to it; True: bound at all), as a new trace. e.g.
        trace.filter("paged", num_reqs_padded=4), trace.filter(conv_state_len=True)."""
        unknown = sorted(set(dims) - set(DIMS))
        if unknown:
            raise NameError(f"filter: {unknown} are not dimension names; use names from mtpkit.shapes.DIMS: "
                            f"{sorted(DIMS)}")
        out = ShapeTrace(maxlen=self.entries.maxlen)
        for e in self.entries:
            if function is not None and function not in e.function:
                continue
            if all(k in e.dims and (v is True or e.dims[k] == v) for k, v in dims.items()):
                out.entries.append(e)
        return out

    def html(self, last: int | None = None) -> str:
        """An HTML table: function, num_reqs, num_reqs_padded, bundle, every other bound
        dimension, and the arguments' shapes and dtypes (filter first to narrow it)."""
        return render_html("trace_table", list(self.entries)[-last:] if last else list(self.entries)) or ""

    def _repr_html_(self) -> str:  # Jupyter: the last 200 calls (filter() for others)
        n = len(self.entries)
        note = f"<div style='font-size:11px'>last 200 of {n} calls; use .filter() / .html()</div>" if n > 200 else ""
        return note + self.html(last=200)

    def table(self, last: int | None = None, args: bool = True) -> str:
        """A readable table: one row per call, its dimension bindings, then its arguments."""
        rows = list(self.entries)[-last:] if last else list(self.entries)
        if not rows:
            return "(shape trace is empty)"
        width = max(len(r.function) for r in rows)
        lines = [f"{'function':<{width}}  dimensions", f"{'-' * width}  {'-' * 40}"]
        for r in rows:
            dims = " ".join(f"{k}={v}" for k, v in r.dims.items())
            lines.append(f"{r.function:<{width}}  {dims}")
            if args:
                for name, desc in r.args.items():
                    lines.append(f"{'':<{width}}    {name}: {desc}")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython display
        p.text(self.table())

    def __repr__(self) -> str:
        return f"ShapeTrace({len(self)} calls)"


def _env_debug() -> bool:
    return os.environ.get("MTPKIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


class _Switch:
    # The one piece of global state: the active trace (None = debug off).
    trace: ShapeTrace | None = ShapeTrace() if _env_debug() else None


def is_debug() -> bool:
    return _Switch.trace is not None


def set_debug(on: bool) -> ShapeTrace | None:
    """Turn checking on or off for the whole process; returns the active trace."""
    if on and _Switch.trace is None:
        _Switch.trace = ShapeTrace()
    elif not on:
        _Switch.trace = None
    return _Switch.trace


def shape_trace() -> ShapeTrace | None:
    return _Switch.trace


@contextlib.contextmanager
def debug(enabled: bool = True):
    """`with mtpkit.debug() as trace:` checks every boundary and records a fresh trace."""
    previous = _Switch.trace
    _Switch.trace = ShapeTrace() if enabled else None
    try:
        yield _Switch.trace
    finally:
        _Switch.trace = previous


# ---------------------------------------------------------------------------------------
# annotations


def _array_types(ann) -> list[type]:
    """The jaxtyping array types inside an annotation (unwrapping Optional / unions)."""
    if isinstance(ann, type) and issubclass(ann, AbstractArray):
        return [ann]
    out = []
    for a in typing.get_args(ann):
        out.extend(_array_types(a))
    return out


def _dim_names(arr_type) -> list[str]:
    names = []
    for d in arr_type.dims:
        name = getattr(d, "name", None)
        if isinstance(name, str):
            names.append(name)
        elif hasattr(d, "elem") and isinstance(d.elem, str):  # symbolic: "num_reqs+1"
            for tok in _identifiers(d.elem):
                names.append(tok)
    return names


def _identifiers(expr: str) -> list[str]:
    import re

    return [t for t in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", expr)]


def _validate_vocabulary(where: str, hints: dict) -> None:
    for pname, ann in hints.items():
        for arr in _array_types(ann):
            for name in _dim_names(arr):
                if name not in DIMS:
                    raise NameError(
                        f"{where}: parameter {pname!r} uses dimension {name!r}, which is not in "
                        f"mtpkit.shapes.DIMS; use one of {sorted(DIMS)} or add it there"
                    )


def _bind(arr_type, shape: tuple[int, ...], into: dict[str, int]) -> None:
    dims = arr_type.dims
    variadic = [i for i, d in enumerate(dims) if getattr(d, "variadic", False) or
                type(d).__name__ in ("_NamedVariadicDim", "_anonymous_variadic_dim")]
    n = len(dims)
    for i, d in enumerate(dims):
        name = getattr(d, "name", None)
        if not isinstance(name, str) or i in variadic:
            continue
        if variadic and i > variadic[0]:
            j = len(shape) - (n - i)
        else:
            j = i
        if 0 <= j < len(shape):
            into.setdefault(name, int(shape[j]))


def _describe(value) -> str | None:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return None


def _record(qualname: str, hints: dict, bound: inspect.BoundArguments, result) -> None:
    trace = _Switch.trace
    if trace is None:
        return
    dims: dict[str, int] = {}
    args: dict[str, str] = {}
    for name, value in bound.arguments.items():
        ann = hints.get(name)
        if isinstance(value, torch.Tensor):
            args[name] = _describe(value)
            for arr in _array_types(ann):
                if len(arr.dims) == value.ndim or any(
                    "Variadic" in type(d).__name__ or "variadic" in type(d).__name__ for d in arr.dims
                ):
                    _bind(arr, tuple(value.shape), dims)
                    break
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, torch.Tensor):
                    args[f"{name}.{f.name}"] = _describe(v)
            dims.update({k: v for k, v in getattr(value, "_bound_dims", {}).items() if k not in dims})
        elif isinstance(value, int) and not isinstance(value, bool) and name in DIMS:
            dims.setdefault(name, value)
    if isinstance(result, torch.Tensor):
        args["return"] = _describe(result)
        for arr in _array_types(hints.get("return")):
            if len(arr.dims) == result.ndim:
                _bind(arr, tuple(result.shape), dims)
                break
    trace.entries.append(TraceEntry(qualname, dims, args))


def _shape_error(qualname: str, err: Exception) -> ShapeError:
    """A ShapeError with the parts of jaxtyping's message a reader needs picked out."""
    import re

    msg = str(err)
    arg = re.search(r"typechecking parameter '(\w+)'", msg) or re.search(r"checking the (return) value", msg)
    actual = re.search(r"^Actual value: (.*)$", msg, re.M)
    expected = re.search(r"^Expected type: (.*)$", msg, re.M)
    bindings = {}
    tail = msg.split("axis annotation are as follows.", 1)
    if len(tail) == 2:
        for m in re.finditer(r"^(\w+)=(-?\d+)$", tail[1], re.M):
            bindings[m.group(1)] = int(m.group(2))
    return ShapeError(f"shape check failed at {qualname}:\n{msg}", qualname, bindings,
                      arg.group(1) if arg else None, actual.group(1) if actual else None,
                      expected.group(1).rstrip(".") if expected else None)


def _is_symbolic(ann) -> bool:
    return any(hasattr(d, "elem") and isinstance(d.elem, str)
               for arr in _array_types(ann) for d in arr.dims)


def _symbolic_last(fn, hints: dict, sig: inspect.Signature):
    """A keyword-only stand-in for `fn` whose parameters with symbolic dims ("num_reqs+1")
    come last, or None when `fn` needs none. jaxtyping evaluates a symbolic dim when it
    reaches that parameter, so `query_start_loc: "num_reqs+1"` before `slots: "num_reqs"`
    would fail although the signature is fine; checking in this order fixes that."""
    params = list(sig.parameters.values())
    order = sorted(params, key=lambda p: _is_symbolic(hints.get(p.name)))
    plain_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if order == params or any(p.kind not in plain_kinds for p in params):
        return None
    ns: dict = {"_fn": fn}
    names = ", ".join(p.name for p in order)
    call = ", ".join(f"{p.name}={p.name}" for p in params)
    exec(f"def _shim(*, {names}):\n    return _fn({call})\n", ns)
    shim = ns["_shim"]
    shim.__kwdefaults__ = {p.name: p.default for p in params if p.default is not p.empty}
    shim.__annotations__ = {p.name: hints[p.name] for p in order if p.name in hints}
    if "return" in hints:
        shim.__annotations__["return"] = hints["return"]
    shim.__name__, shim.__qualname__, shim.__module__ = fn.__name__, fn.__qualname__, fn.__module__
    return shim


def checked(fn):
    """Check `fn`'s jaxtyping annotations with beartype in debug mode; free otherwise."""
    qualname = f"{fn.__module__.replace('mtpkit.', '')}.{fn.__qualname__}"
    hints = typing.get_type_hints(fn)
    _validate_vocabulary(qualname, hints)
    sig = inspect.signature(fn)
    shim = _symbolic_last(fn, hints, sig)
    typed = jaxtyped(typechecker=beartype)(shim or fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _Switch.trace is None or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            if shim is None:
                result = typed(*args, **kwargs)
            else:
                result = typed(**sig.bind(*args, **kwargs).arguments)
        except (TypeCheckError, BeartypeException) as e:
            raise _shape_error(qualname, e) from None
        _record(qualname, hints, sig.bind(*args, **kwargs), result)
        return result

    wrapper.__mtpkit_checked__ = True
    return wrapper


def shaped_dataclass(cls=None, *, frozen: bool = False):
    """A dataclass whose tensor fields are checked (dims consistent across fields) at
    construction in debug mode. Bound dims are kept on the instance for the trace."""

    def wrap(cls):
        # dataclass() only calls __post_init__ if it exists when the class is made, so
        # install it first; it reads the field list made afterwards from `spec`.
        spec: dict = {}
        user_post_init = cls.__dict__.get("__post_init__")

        def __post_init__(self):
            if user_post_init is not None:
                user_post_init(self)
            if _Switch.trace is not None:
                _check_fields(self, spec)

        cls.__post_init__ = __post_init__
        cls = dataclasses.dataclass(frozen=frozen)(cls)
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        qualname = f"{cls.__module__.replace('mtpkit.', '')}.{cls.__qualname__}"
        _validate_vocabulary(qualname, hints)
        # A keyword-only function with the fields as parameters, so jaxtyping binds dims
        # across all fields at once.
        ns: dict = {}
        exec(f"def _fields(*, {', '.join(names)}):\n    return None\n", ns)
        fields_fn = ns["_fields"]
        fields_fn.__annotations__ = {n: hints[n] for n in names}
        fields_fn.__qualname__ = fields_fn.__name__ = cls.__name__
        fields_fn.__module__ = cls.__module__
        spec.update(qualname=qualname, hints=hints, names=names,
                    typed=jaxtyped(typechecker=beartype)(fields_fn))
        return cls

    return wrap(cls) if cls is not None else wrap


def _check_fields(obj, spec: dict) -> None:
    names, hints, qualname = spec["names"], spec["hints"], spec["qualname"]
    values = {n: getattr(obj, n) for n in names}
    try:
        spec["typed"](**values)
    except (TypeCheckError, BeartypeException) as e:
        raise _shape_error(qualname, e) from None
    dims: dict[str, int] = {}
    for n in names:
        v = values[n]
        if isinstance(v, torch.Tensor):
            for arr in _array_types(hints[n]):
                if len(arr.dims) == v.ndim:
                    _bind(arr, tuple(v.shape), dims)
                    break
        elif isinstance(v, int) and not isinstance(v, bool) and n in DIMS:
            dims.setdefault(n, v)
    object.__setattr__(obj, "_bound_dims", dims)
    _Switch.trace.entries.append(
        TraceEntry(qualname, dims, {n: _describe(v) for n, v in values.items() if _describe(v)})
    )
