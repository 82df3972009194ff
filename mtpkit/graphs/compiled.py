"""Compiled CPU decode graphs (opt-in: `LLM(compile=...)`): each graph the CPU path traces
(graphs.captured: verify / propose per (n, context bucket), the prefill proposal, the controls)
is also compiled, and the compiled code replays instead of the TorchScript trace.

Modes (benchmarks/compile_modes.py measures them; docs/performance.md has the table and the choice):
- "inductor": torch.compile(fullgraph=True, dynamic=False), inductor's default mode (C++ / OpenMP
  kernels on CPU). Cacheable by inductor's own FX / AOT caches: a warm start recompiles in seconds.
- "freeze": the same with `torch._inductor.config.freezing` and max-autotune's C++ GEMM template:
  the weights become constants of the compiled code, laid out for its matmuls. Fastest steps, but
  minutes of compilation per graph and not served by inductor's caches.
- "aot": torch.export + AOTInductor, one package per graph on disk (`cache_dir`, default
  ~/.cache/mtpkit/aot), named by a hash of the model (its weights, their layout, its modules' repr),
  the mtpkit source a graph can run (`identity_sources`), the torch version and the graph (name, argument shapes): no dynamo guards and no
  Python wrapper at replay; a warm start only loads the packages.
- "aot-tuned": those packages compiled with "freeze"'s settings (frozen weights, max-autotune's C++
  GEMM template): "freeze"'s fast matmuls without dynamo, cached alike; minutes per graph cold.
Both max-autotune modes render the template's float32 micro-kernel as graphs/micro_gemm.py writes
it (plain loops, packed weights prefetched: bit-identical products, more of the memory bandwidth).
The cache tensors are arguments of every graph (CapturedSteps._flat), never constants: they change
between replays. The weights are constants in "freeze" and "aot" only, which is sound because
nothing writes a model's weights after load (tests/test_compiled.py checks the hash is stable
over a generation), and "aot"'s package name holds their hash.

Compilation is lazy per graph: a graph's trace serves its first `compile_after` replays (0:
compile at once), so a short run never waits, and only graphs used that often are compiled.
A graph whose compilation fails keeps its trace (with a warning).
"""

import contextlib
import dataclasses
import hashlib
import inspect
import os
import time
import types
import warnings
from pathlib import Path

import torch

from mtpkit.graphs import micro_gemm

MODES = ("inductor", "freeze", "aot", "aot-tuned")
AOT_MODES = ("aot", "aot-tuned")
# torch.compile's backend for "inductor" / "freeze" (tests swap in "aot_eager": dynamo's capture
# without inductor's C++ compilation, which costs minutes cold).
BACKEND = "inductor"
# A traced graph replays this many times before it is compiled (CapturedSteps traces a graph after
# its own CPU_TRACE_AFTER direct calls): a compiled graph repays its compilation only over a long run.
COMPILE_AFTER = 64


def default_cache_dir() -> Path:
    return Path(os.environ.get("MTPKIT_CACHE", Path.home() / ".cache" / "mtpkit")) / "aot"


@dataclasses.dataclass
class CompileRecord:
    """One compiled graph: its name, mode, seconds spent compiling (or loading a package), and
    whether it came from the on-disk package cache ("aot")."""

    name: str
    mode: str
    seconds: float
    cached: bool = False
    error: str | None = None


class Compiler:
    """Compiles the graphs a CapturedSteps traces. `modules`: every nn.Module the bodies run
    (the target, the drafter's), whose weights and repr name an "aot" package."""

    def __init__(self, mode: str, modules: list[torch.nn.Module], cache_dir: Path | None = None,
                 compile_after: int = COMPILE_AFTER, settings: str = ""):
        if mode not in MODES:
            raise ValueError(f"compile={mode!r} must be one of {MODES} or None")
        self.mode, self.modules, self.compile_after = mode, modules, compile_after
        self.settings = settings   # body_settings: what the graphs bake in besides modules and shapes
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.records: list[CompileRecord] = []
        self._identity: str | None = None

    # ---- what a replay calls ------------------------------------------------------------
    def wrap(self, traced, fn, args: tuple, name: str):
        """What replays graph `name`: `traced` until it has served compile_after replays, then
        `fn` (the body over flat tensor args, as traced) compiled. `args`: inert arguments of the
        graph's shapes (compiled now when compile_after is 0)."""
        graph = LazyCompiled(self, traced, fn, name)
        if self.compile_after == 0:
            graph.compile(args)
        return graph

    def compile(self, fn, args: tuple, name: str):
        """fn compiled for args' shapes by this mode; the call that compiles ("inductor",
        "freeze") also runs fn once on args (CapturedSteps passes inert rows or the step's own)."""
        t = time.perf_counter()
        cached = False
        if self.mode in AOT_MODES:
            compiled, cached = self._aot(fn, args, name)
        else:
            compiled = _inductor(fn, args, name, freeze=self.mode == "freeze")
        self.records.append(CompileRecord(name, self.mode, time.perf_counter() - t, cached))
        return compiled

    # ---- AOTInductor packages -------------------------------------------------------------
    def identity(self) -> str:
        """The model's part of a package name: its weights (values, shapes, dtypes, strides), the
        repr of its modules (their sizes and settings), the mtpkit source a graph runs and torch's version."""
        if self._identity is None:
            self._identity = model_identity(self.modules, self.settings)
        return self._identity

    def package_path(self, args: tuple, name: str) -> Path:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.identity().encode())
        h.update(name.encode())
        h.update(self.mode.encode())
        for a in args:
            h.update(f"{tuple(a.shape)}{a.stride()}{a.dtype}{a.device}".encode())
        return self.cache_dir / f"{name}-{h.hexdigest()}.pt2"

    def _aot(self, fn, args: tuple, name: str):
        path = self.package_path(args, name)
        cached = path.exists()
        if not cached:
            path.parent.mkdir(parents=True, exist_ok=True)
            body = _Body(fn, self.modules)
            with _compiling():
                exported = torch.export.export(body, tuple(args), strict=False)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
                with _gemm_kernel(self.mode == "aot-tuned"):
                    torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp),
                                                             inductor_configs=_aot_options(self.mode))
            os.replace(tmp, path)   # atomic: a concurrent process loads a whole package or none
        runner = torch._inductor.aoti_load_package(str(path))
        return _AOTGraph(runner), cached

    def describe(self) -> str:
        done = [r for r in self.records if r.error is None]
        failed = len(self.records) - len(done)
        secs = sum(r.seconds for r in done)
        what = {"inductor": "inductor (default mode)", "freeze": "inductor (freezing + max-autotune GEMMs)",
                "aot": f"AOTInductor packages ({self.cache_dir})",
                "aot-tuned": f"AOTInductor packages with max-autotune GEMMs ({self.cache_dir})"}[self.mode]
        cached = sum(r.cached for r in done)
        return (f"compiled by {what} after {self.compile_after} traced replays: {len(done)} graphs "
                f"({cached} from the cache) in {secs:.1f} s" + (f", {failed} failed (traced)" if failed else ""))


class LazyCompiled:
    """A graph replayed by its trace, then by its compiled code (Compiler.wrap)."""

    def __init__(self, compiler: Compiler, traced, fn, name: str):
        self.compiler, self.traced, self.fn, self.name = compiler, traced, fn, name
        self.compiled = None
        self.uses = 0

    def compile(self, args: tuple):
        try:
            self.compiled = self.compiler.compile(self.fn, args, self.name)
        except Exception as e:  # noqa: BLE001 - the trace goes on serving
            warnings.warn(f"mtpkit: compiling CPU graph {self.name} failed ({type(e).__name__}: {e}); "
                          "its TorchScript trace replays instead", RuntimeWarning, stacklevel=3)
            self.compiler.records.append(CompileRecord(self.name, self.compiler.mode, 0.0, error=str(e)))
            self.compiled = self.traced
        return self.compiled

    def __call__(self, *args):
        if self.compiled is not None:
            return self.compiled(*args)
        self.uses += 1
        if self.uses <= self.compiler.compile_after:
            return self.traced(*args)
        if self.compiler.mode in AOT_MODES:   # export does not run the body: compile, then run
            return self.compile(args)(*args)
        # inductor compiles on its first call, which also runs the graph on this step's arguments
        compiled = _inductor_lazy(self.fn, self.name, freeze=self.compiler.mode == "freeze")
        t = time.perf_counter()
        try:
            with _compiling():
                out = compiled(*args)
        except Exception as e:  # noqa: BLE001 - a failure before any write: dynamo raises while tracing
            warnings.warn(f"mtpkit: compiling CPU graph {self.name} failed ({type(e).__name__}: {e}); "
                          "its TorchScript trace replays instead", RuntimeWarning, stacklevel=2)
            self.compiler.records.append(CompileRecord(self.name, self.compiler.mode, 0.0, error=str(e)))
            self.compiled = self.traced
            return self.traced(*args)
        self.compiler.records.append(CompileRecord(self.name, self.compiler.mode, time.perf_counter() - t))
        self.compiled = compiled
        return out


# ---- inductor ---------------------------------------------------------------------------
def _fresh(fn, name: str):
    """A function calling fn with a code object of its own: dynamo keeps its compiled entries per
    code object, and one shared by every graph (every key's `_flat` lambda has the same code)
    would hit its recompile limit at the 9th key and guard-check every entry at each call."""
    def call(*args):
        return fn(*args)
    code = call.__code__.replace(co_name=name.replace("-", "_"))
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)


def _inductor_options(freeze: bool) -> dict:
    if not freeze:
        return {}
    # max_autotune_gemm_backends ATEN,CPP: the C++ GEMM template (the gain at M = 1..32) or MKL,
    # whichever autotuning measures faster.
    return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def _gemm_kernel(freeze: bool):
    """The modes with max-autotune's C++ GEMM template compile it as graphs/micro_gemm.py's loops
    (bit-identical products, more of the memory bandwidth at M >= 2); the others render nothing from it."""
    return micro_gemm.patched() if freeze else contextlib.nullcontext()


def _aot_options(mode: str) -> dict:
    """AOTInductor's settings: "aot-tuned" those of "freeze" (the weights are constants of a package
    either way; freezing lets the C++ GEMM template pack them)."""
    return _inductor_options(freeze=mode == "aot-tuned")


def _inductor_lazy(fn, name: str, freeze: bool):
    """torch.compile of fn, compiling on its first call under this mode's inductor settings (the
    `options=` of torch.compile were not honoured for these, so the settings are patched around
    the compiling call and its possible recompiles)."""
    compiled = torch.compile(_fresh(fn, name), fullgraph=True, dynamic=False, backend=BACKEND)
    options = _inductor_options(freeze)

    def call(*args):
        with torch._inductor.config.patch(options), _gemm_kernel(freeze):
            return compiled(*args)
    return call


def _inductor(fn, args: tuple, name: str, freeze: bool):
    compiled = _inductor_lazy(fn, name, freeze)
    with _compiling():
        compiled(*args)
    return compiled


class _compiling:
    """Compile under inference mode, as the engine's steps run (a graph compiled outside it would
    record autograd state the replays do not have)."""

    def __enter__(self):
        self._inf = torch.inference_mode()
        self._inf.__enter__()

    def __exit__(self, *exc):
        self._inf.__exit__(*exc)


# ---- AOTInductor ------------------------------------------------------------------------
class _Body(torch.nn.Module):
    """fn as a module whose submodules are the model's, so torch.export sees their weights as
    parameters (constants of the package) rather than tensors captured from a closure."""

    def __init__(self, fn, modules: list[torch.nn.Module]):
        super().__init__()
        self.fn = fn
        self.parts = torch.nn.ModuleList(modules)

    def forward(self, *args):
        return self.fn(*args)


class _AOTGraph:
    """A loaded AOTInductor package: called with the graph's flat arguments. The package's own
    __call__ parses its input and output specs (JSON) and flattens the arguments through pytree
    at every call, host work that cost about as much as a small graph's replay; a graph's
    arguments are flat tensors already, so its loader runs them directly, and the outputs are
    rebuilt by the output spec parsed once."""

    def __init__(self, runner):
        self.runner = runner
        loader = getattr(runner, "loader", None)
        self._run = None
        if loader is not None and hasattr(loader, "boxed_run") and hasattr(loader, "get_call_spec"):
            from torch.utils import _pytree as pytree
            out_spec = pytree.treespec_loads(loader.get_call_spec()[1])
            self._run, self._out_spec, self._unflatten = loader.boxed_run, out_spec, pytree.tree_unflatten
            # The graphs return one tensor or a tuple of tensors: rebuilt without pytree.
            if out_spec.is_leaf():
                self._unflatten = lambda out, spec: out[0]
            elif out_spec.type is tuple and all(c.is_leaf() for c in out_spec.children()):
                self._unflatten = lambda out, spec: tuple(out)

    def __call__(self, *args):
        if self._run is None:
            return self.runner(*args)
        return self._unflatten(self._run(list(args)), self._out_spec)


# mtpkit's files no compiled graph runs (host work around the steps: the engine loop, text, the
# front ends, structured outputs' eager masks, this module, hashed by its compiling parts): an edit
# there leaves every package valid. The step bodies sit in engine/ but are the graphs' code.
HOST_ONLY = ("engine/", "text/", "notebook/", "serve/", "structured/", "llm.py", "cli.py", "display.py",
             "__main__.py", "graphs/compiled.py")
GRAPH_CODE_IN_HOST_DIRS = ("engine/step_bodies.py",)


def identity_sources() -> list[Path]:
    """The source files a package's name hashes: every mtpkit file a step body can run."""
    src = Path(__file__).resolve().parents[1]
    out = []
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(src).as_posix()
        if rel in GRAPH_CODE_IN_HOST_DIRS or not rel.startswith(HOST_ONLY):
            out.append(f)
    return out


def model_identity(modules: list[torch.nn.Module], settings: str = "") -> str:
    """A hash of everything an "aot" package bakes in besides its graph: the modules' weights
    (bytes, shapes, dtypes, strides) and buffers, their repr, the bodies' plain settings
    (`body_settings`), the mtpkit source a graph runs (identity_sources: the host-only files are
    left out, so editing them keeps every package) and torch's version."""
    h = hashlib.blake2b(digest_size=16)
    h.update(torch.__version__.encode())
    h.update(settings.encode())
    src = Path(__file__).resolve().parents[1]
    for f in identity_sources():
        h.update(f.relative_to(src).as_posix().encode())
        h.update(f.read_bytes())
    for part in (_Body, _aot_options, _inductor_options, _gemm_kernel, Compiler._aot):   # this module's share of a package
        h.update(inspect.getsource(part).encode())
    seen: set[int] = set()
    for m in modules:
        h.update(repr(m).encode())
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            h.update(f"{name}{tuple(t.shape)}{t.stride()}{t.dtype}".encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def body_settings(bodies) -> str:
    """The plain values the step bodies read besides modules and tensors, which a graph bakes in
    as constants: the bundle and the drafter's own settings (its num_spec, block size, ...). Two
    engines that differ only there (a drafter with no cache of its own, whose tensors have the same
    shapes at any num_spec) must never share a package."""
    parts = [f"bundle={bodies.bundle}"]
    drafter = bodies.drafter
    if drafter is not None:
        parts.append(type(drafter).__qualname__)
        parts += [f"{k}={v!r}" for k, v in sorted(vars(drafter).items())
                  if isinstance(v, (bool, int, float, str, type(None)))]
    return ";".join(parts)


def body_modules(model, drafter) -> list[torch.nn.Module]:
    """The nn.Modules the step bodies run: the target and whatever modules the drafter holds."""
    mods = [model]
    for v in vars(drafter).values() if drafter is not None else ():
        if isinstance(v, torch.nn.Module) and all(v is not m for m in mods):
            mods.append(v)
    return mods
