"""Shared fixtures for the mtpkit test suite.

- ``_single_thread`` (autouse, session): ``torch.set_num_threads(1)`` for every test. The tiny
  models gain nothing from intra-op threads, and OpenMP spinning on a loaded 2-core machine made
  the suite several times slower (see tests/oracle.py ``single_thread``).
- ``_fixed_port_turn`` (autouse, module): the files marked ``fixed_port`` (they start
  accelerate's launchers, which meet on port 29500) run one at a time under pytest-xdist.
- ``hf_checkpoint``: a factory ``hf_checkpoint(name, seed, with_mtp=True, lm_head_scale=4.0)``
  returning ``(hf_model, checkpoint_dir)`` for a TINY_CONFIGS entry. Each distinct argument set is
  built and saved once per session (float64 weights on disk, ``mtp.*`` tensors appended when
  ``with_mtp``). The HF model is shared between tests: treat it (and the directory) as read-only;
  copy the directory (``shutil.copytree``) before editing a checkpoint.

``lm_head_scale`` defaults to 4: the std-0.05 perturbed models otherwise give max |logit| ~1-2
over a vocab of 128-256 (near-uniform distributions, many near-ties); x4 gives max |logit| ~3-8.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# training/ (the embedded models' training code) is not part of the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import oracle as O  # noqa: E402

# Triton reads TRITON_INTERPRET when it is first imported, and torch.compile (tests/test_compiled.py)
# imports it: set here, before any test file, what the Triton test files set for a CPU run (a
# GPU run of them, MTPKIT_TRITON_TEST_DEVICE=cuda, compiles natively).
if os.environ.get("MTPKIT_TRITON_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _libc():
    """glibc, set to return freed tensor memory to the system: large blocks always mmap'd (a
    fixed M_MMAP_THRESHOLD; glibc's default raises it as blocks are freed, and then keeps them in
    a heap that only grows), so the suite's one process stays near what its live tests hold
    instead of growing to the sum of their peaks (README: the suite's peak memory)."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)     # M_MMAP_THRESHOLD = 1 MiB
        return libc
    except (OSError, AttributeError):   # not glibc: nothing to tune
        return None


_LIBC = _libc()


# A process started as a background job of a non-interactive shell (`pytest ... &` in a script)
# inherits SIGINT ignored, and Python then leaves it ignored: every Ctrl-C test would see
# _thread.interrupt_main do nothing. The tests run under the handler an interactive user has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="module")
def _sigint_handler_kept(request):
    """A test file that leaves SIGINT changed in this worker (a library's subprocess or
    compile-worker set-up ignoring it, say) would make every later Ctrl-C test in the process
    fail (_thread.interrupt_main does nothing when SIGINT is ignored: the interrupt tests'
    "DID NOT RAISE"). Put back, and said, naming the file."""
    import signal
    import warnings
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before and before is not None:
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"{request.node.nodeid} left the SIGINT handler changed ({before!r} -> {after!r}); "
                      "put back", RuntimeWarning, stacklevel=1)


# Module-level memos some test files keep (LLMs built once per configuration, reference outputs).
_MEMOS = ("_LLMS", "_REFS", "_REF", "_REFERENCE")


@pytest.fixture(autouse=True, scope="module")
def _give_back_memory(request):
    """After each test file: empty its module-level memos (`_MEMOS`: the module object lives on,
    and under pytest-xdist a worker runs many files after it), closing the LLMs in them; collect
    what its tests left (models, engines in reference cycles) and hand the freed heap back
    (malloc_trim)."""
    yield
    for name in _MEMOS:
        memo = getattr(request.module, name, None)
        if isinstance(memo, dict):
            for value in memo.values():
                if hasattr(value, "close") and hasattr(value, "engine"):   # an LLM
                    value.close()
            memo.clear()
    import gc
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@pytest.fixture(autouse=True, scope="module")
def _fixed_port_turn(request, tmp_path_factory):
    """accelerate's debug_launcher and notebook_launcher rendezvous on a fixed port (29500): two
    such jobs at once (pytest-xdist workers, README's `-n 2`) would meet on it. The files that
    start one are marked `fixed_port` and take turns, holding a file lock in the run's base
    directory (shared by the workers) while their tests run; the other files go on meanwhile."""
    if request.node.get_closest_marker("fixed_port") is None:
        yield
        return
    import fcntl
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with open(shared / "fixed_port.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    with O.single_thread():
        yield


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """A test that runs examples/serve_batch.py in-process makes accelerate's process state
    here; a later debug_launcher job would fork it into its ranks, which then never join their
    group. Every test starts and ends without it."""
    yield
    if "accelerate" in sys.modules:
        from accelerate.state import PartialState
        PartialState._reset_state()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: (name, seed, with_mtp=True, lm_head_scale=4.0) -> (hf_model, checkpoint path)."""
    pytest.importorskip("transformers")
    cache: dict[tuple, tuple] = {}
    models: dict[tuple, object] = {}

    def get(name: str, seed: int, with_mtp: bool = True, lm_head_scale: float = 4.0):
        key = (name, int(seed), bool(with_mtp), float(lm_head_scale))
        if key not in cache:
            mkey = key[:2] + key[3:]
            if mkey not in models:
                models[mkey] = O.build_hf_model(name, seed=seed, lm_head_scale=lm_head_scale)
            model = models[mkey]
            tag = f"{name}-s{seed}-{'mtp' if with_mtp else 'nomtp'}-x{lm_head_scale:g}"
            path = tmp_path_factory.mktemp(tag)
            mtp = O.make_mtp_state_dict(name, seed) if with_mtp else None
            O.save_checkpoint(model, path, mtp_state=mtp)
            cache[key] = (model, path)
        return cache[key]

    return get
