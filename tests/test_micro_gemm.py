"""graphs/micro_gemm.py: inductor's float32 C++ GEMM micro-kernel rendered as plain loops with the
packed weights prefetched, in the modes that compile max-autotune's C++ template ("freeze",
"aot-tuned"). The products must be the template's own, bit for bit (same fused multiply-adds in
the same order), the patch must really reach the generated code, and leave torch's template as it
was. Compiles small GEMMs with inductor for real (~10 s)."""

import contextlib

import pytest
import torch

from mtpkit.graphs import compiled, micro_gemm


def test_this_torch_takes_the_patch():
    """A torch whose template text moved on compiles with its own kernel (the patch is a no-op,
    below): correct, but the bandwidth is lost, so the suite says so rather than skipping."""
    assert micro_gemm.patch_applies(), ("torch's CppMicroGemmFP32Vec template no longer has the text "
                                        "graphs/micro_gemm.py patches: update the patch for this torch")


OPTS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP", "fx_graph_cache": False}


class Two(torch.nn.Module):
    """A K=64 weight of N=80 outputs (full register blocks and, at most blockings, a tail) and a
    second weight read with alpha != 1 (a scaled product, addmm-like)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(80, 64, generator=g).t().contiguous().t(), requires_grad=False)
        self.v = torch.nn.Parameter(torch.randn(48, 64, generator=g).t().contiguous().t(), requires_grad=False)

    def forward(self, x):
        return torch.mm(x, self.w.t()), torch.mm(x, self.v.t()) * 0.5


def compile_and_code(mod, x, patch: bool):
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    with torch.inference_mode(), torch._inductor.config.patch(OPTS), \
            (micro_gemm.patched() if patch else contextlib.nullcontext()):
        fn = torch.compile(mod, fullgraph=True, dynamic=False)
        out, code = run_and_get_code(fn, x)
    return out, "\n".join(code)


@pytest.mark.parametrize("rows", [4])
def test_patched_kernel_is_generated_and_gives_the_templates_products(rows):
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    if not pick_vec_isa():   # an x86-64 CPU without AVX2: inductor has no C++ GEMM template to patch
        pytest.skip("inductor found no vector ISA (AVX2 / AVX-512) on this CPU: it renders no C++ GEMM")
    mod = Two().eval()
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    before = micro_gemm._template_class().TEMPLATE_KERNEL
    plain, plain_code = compile_and_code(mod, x, patch=False)
    ours, our_code = compile_and_code(mod, x, patch=True)
    assert micro_gemm._template_class().TEMPLATE_KERNEL == before       # put back after compiling
    assert "micro_gemm_kernel<" in plain_code, "the C++ GEMM template was not used: nothing to compare"
    assert micro_gemm.MARKER not in plain_code
    assert micro_gemm.MARKER in our_code                                 # the loops reached the kernel
    for a, b, ref in zip(plain, ours, (x.double() @ mod.w.double().t(), 0.5 * (x.double() @ mod.v.double().t()))):
        # Same fused multiply-adds in the same order as the template: bit-identical by construction.
        assert torch.equal(a, b)
        assert torch.allclose(b.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_different_template_is_left_alone(monkeypatch):
    cls = micro_gemm._template_class()
    monkeypatch.setattr(cls, "TEMPLATE_KERNEL", cls.TEMPLATE_KERNEL.replace("vc[idx] = at::vec::fmadd", "vc[idx] = fma"))
    changed = cls.TEMPLATE_KERNEL
    assert not micro_gemm.patch_applies()
    with micro_gemm.patched() as applied:
        assert not applied and cls.TEMPLATE_KERNEL == changed
    assert cls.TEMPLATE_KERNEL == changed


def test_only_the_tuned_modes_patch(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(True)
        yield True
    monkeypatch.setattr(micro_gemm, "patched", spy)
    with compiled._gemm_kernel(freeze=False):
        pass
    assert entered == []
    with compiled._gemm_kernel(freeze=True):
        pass
    assert entered == [True]
