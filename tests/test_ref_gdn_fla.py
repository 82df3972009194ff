"""Cross-check of the gated delta rule references against fla-core's naive implementations,
an independent author's reading of the same recurrence.

fla-core must NOT be importable as `fla` in the environment that runs the transformers
oracle: transformers decorates Qwen3-Next's GDN functions at import time with "use fla if
importable", and fla's Triton kernels then fail on CPU (RuntimeError: 0 active drivers).
So fla-core is installed into a side folder and only its pure-torch naive.py is loaded here,
by file path, without `fla` ever entering sys.modules:

    pip install --no-deps --target .fla-ref "fla-core==0.6.0"

(MTPKIT_FLA_PATH points elsewhere; an fla-core installed normally is found too.)
"""

import importlib.util
import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

from mtpkit.kernels.gdn import gated_delta_rule_prefill, gdn_chunked_core, gdn_recurrent_core

NAIVE = pathlib.Path("fla", "ops", "gated_delta_rule", "naive.py")


def _load_naive():
    roots = [pathlib.Path(os.environ.get("MTPKIT_FLA_PATH", pathlib.Path(__file__).parents[1] / ".fla-ref"))]
    spec = importlib.util.find_spec("fla")  # locates a regular install without importing it
    if spec is not None and spec.origin:
        roots.append(pathlib.Path(spec.origin).parents[1])
    for root in roots:
        path = root / NAIVE
        if path.is_file():
            mod_spec = importlib.util.spec_from_file_location("_fla_gdn_naive", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
            return module
    pytest.skip('fla-core not found: pip install --no-deps --target .fla-ref "fla-core==0.6.0"',
                allow_module_level=True)


naive = _load_naive()


def _inputs(T, H=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(T, H, dk), dim=-1) * dk ** -0.5
    k = F.normalize(r(T, H, dk), dim=-1)
    return q, k, r(T, H, dv), -F.softplus(r(T, H)), torch.sigmoid(r(T, H)), r(H, dk, dv)


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
def test_recurrent_core_matches_fla_naive_recurrent(T):
    q, k, v, g, beta, s0 = _inputs(T, seed=T)
    o, s = gdn_recurrent_core(q, k, v, g, beta, s0)
    # fla: [B, T, H, D] layout, argument order (q, k, v, beta, g), q scaled inside (scale=1
    # because ours is already scaled), state [B, H, K, V].
    o_ref, s_ref = naive.naive_recurrent_gated_delta_rule(
        q[None], k[None], v[None], beta[None], g[None], scale=1.0, initial_state=s0[None],
        output_final_state=True)
    torch.testing.assert_close(o, o_ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [5, 64, 130])
def test_chunked_core_matches_fla_naive_chunk(T, chunk_size):
    q, k, v, g, beta, s0 = _inputs(T, seed=100 + T)
    o, s = gdn_chunked_core(q, k, v, g, beta, s0, chunk_size=chunk_size)
    # fla's chunk form takes (q, k, v, g, beta): the opposite order of its recurrent form.
    o_ref, s_ref = naive.naive_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=chunk_size, scale=1.0,
        initial_state=s0[None], output_final_state=True)
    torch.testing.assert_close(o, o_ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref[0], atol=2e-5, rtol=1e-5)


def test_prefill_matches_fla_with_default_scale():
    # End to end through gdn_prepare: fla normalises nothing but scales q by dk**-0.5 itself.
    T, hk, hv, dk, dv = 40, 2, 4, 16, 8
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(T, hk, dk, generator=gen), torch.randn(T, hk, dk, generator=gen)
    v = torch.randn(T, hv, dv, generator=gen)
    a, b = torch.randn(T, hv, generator=gen), torch.randn(T, hv, generator=gen)
    A_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    pool = torch.zeros(2, hv, dk, dv)
    out = gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([0, T]),
                                   torch.tensor([0]), torch.tensor([1]), torch.tensor([False]))
    def l2(x):  # transformers' / fla's l2norm, then the key-head -> value-head repeat
        return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(2, 1)

    g = -A_log.exp() * F.softplus(a + dt_bias)
    o_ref, s_ref = naive.naive_recurrent_gated_delta_rule(
        l2(q)[None], l2(k)[None], v[None], b.sigmoid()[None], g[None], output_final_state=True)
    torch.testing.assert_close(out, o_ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], s_ref[0], atol=2e-5, rtol=1e-5)
