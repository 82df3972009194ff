"""Inductor's C++ GEMM micro-kernel for float32, rewritten as plain loops that prefetch the packed
weights: what the "freeze" and "aot-tuned" compile modes (graphs/compiled.py) generate their
matmuls with.

A decode or verify step multiplies a few rows (M = 1..8) by every weight of the model once: the
matmuls stream weights from DRAM, so their speed is the bandwidth they draw. Inductor's template
(torch._inductor.codegen.cpp_micro_gemm.CppMicroGemmFP32Vec) writes its register block as
`c10::ForcedUnroll` lambdas over `VectorizedN` arrays and prefetches nothing; the same block
written as loops over plain `Vectorized` arrays, with the packed weights prefetched a few KB
ahead, draws x1.1-1.5 the bandwidth at M = 4 and x1.5-1.7 at M = 8 on the 2-core AMD machine
(M = 1 unchanged; `python benchmarks/micro_gemm.py`, docs/performance.md). The arithmetic is the template's: each output element is the same chain of
fused multiply-adds in k order, so the results are bit-identical.

`patched()` swaps the template's text while a graph compiles (inductor renders it then, autotuning
included, so the autotuner times the loops) and puts it back after. It changes only the
non-transposed, full-width, float32 x float32 case (the weights of a frozen graph are packed
non-transposed); every other case renders as before. If torch's template no longer has the text
this replaces (another torch version), nothing is patched: `patch_applies()` says so and the
graphs compile with torch's kernel (tests/test_micro_gemm.py then fails, to have the patch looked at). The patch's text is part of every package's name (the package
cache hashes this file with the rest of the graph code: graphs/compiled.identity_sources).
"""

import contextlib
import threading

# Floats ahead of the current k row that each k row prefetches: the packed weight matrix is one
# contiguous stream ([N / block_n, K, block_n]), so this is a distance in that stream (8 KB).
PREFETCH_FLOATS = 2048
MARKER = "mtpkit micro-gemm: plain loops, weights prefetched"

# Inserted before the template's first `loadc` lambda (the non-transposed kernel's): the template's
# VLEN / ROWS / COLS and its arguments (A, B, C, K, lda, ldb, ldc) are in scope there.
_LOOPS = r"""
{%- if not tail_n and input_dtype == torch.float and input2_dtype == torch.float and compute_dtype == torch.float %}
    {   // MARKER
        Vectorized acc[ROWS][COLS];
        for (int r = 0; r < ROWS; ++r)
            for (int c = 0; c < COLS; ++c)
                acc[r][c] = accum ? Vectorized::loadu(C + r * ldc + c * VLEN) : Vectorized(0.0f);
        for (int k = 0; k < K; ++k) {
            const float* b = B + k * ldb;
            for (int c = 0; c < COLS * VLEN; c += 16) __builtin_prefetch(b + c + PREFETCH, 0, 3);
            Vectorized bv[COLS];
            for (int c = 0; c < COLS; ++c) bv[c] = Vectorized::loadu(b + c * VLEN);
            for (int r = 0; r < ROWS; ++r) {
                const Vectorized av(static_cast<float>(A[r * lda + k]){% if alpha != 1 %} * {{alpha}}{% endif %});
                for (int c = 0; c < COLS; ++c) acc[r][c] = at::vec::fmadd(av, bv[c], acc[r][c]);
            }
        }
        for (int r = 0; r < ROWS; ++r)
            for (int c = 0; c < COLS; ++c)
                acc[r][c].store(C + r * ldc + c * VLEN);
        return;
    }
{%- endif %}
""".replace("MARKER", MARKER).replace("PREFETCH", str(PREFETCH_FLOATS))
_ANCHOR = "    auto loadc = [&](auto i) {\n"
# What the kernel computes, as the template writes it: the loops above must stay its equal.
_SAME_AS = ("        vc[idx] = at::vec::fmadd(va, vb[col], vc[idx]);\n",
            "            va = Vectorized(static_cast<{{compute_t}}>(A[row * lda + k]));\n",
            "            vc[i] = Vectorized::loadu(C + row * ldc + col * VLEN);\n")


def _template_class():
    import torch._inductor.lowering  # noqa: F401  (cpp_micro_gemm imports inductor's lowering first)
    from torch._inductor.codegen import cpp_micro_gemm
    return cpp_micro_gemm.CppMicroGemmFP32Vec


_rendered: dict[str, str | None] = {}   # torch's template text -> the patched text (or None)


def _patched_text(text: str) -> str | None:
    """The template with the loops inserted, or None where torch's text is not the one they were
    written against. Memoised: "freeze" enters `patched` at every call of a compiled graph (dynamo
    may recompile at any call)."""
    if text not in _rendered:
        ok = text.count(_ANCHOR) and all(s in text for s in _SAME_AS)
        _rendered[text] = text.replace(_ANCHOR, _LOOPS + _ANCHOR, 1) if ok else None   # the first: the non-transposed kernel's
    return _rendered[text]


def patch_applies() -> bool:
    """Whether this torch's template has the text the patch replaces."""
    return _patched_text(_template_class().TEMPLATE_KERNEL) is not None


_lock = threading.RLock()


@contextlib.contextmanager
def patched():
    """Inductor renders its float32 micro-GEMM as the loops above while this is entered (no-op
    where the template's text differs). One compile at a time holds it (the template is a class
    attribute): a second thread compiling waits."""
    with _lock:
        cls = _template_class()
        original = cls.TEMPLATE_KERNEL
        new = _patched_text(original)
        if new is not None:
            cls.TEMPLATE_KERNEL = new
        try:
            yield new is not None
        finally:
            cls.TEMPLATE_KERNEL = original
