"""Every Triton kernel against its torch reference (mtpkit/kernels/{gdn,conv,paged}.py).

On CPU the kernels run under the Triton interpreter. `triton.jit` reads TRITON_INTERPRET
when a kernel is DECORATED, i.e. when mtpkit.kernels.triton_* is imported (not at launch), so
this module sets it before anything imports those modules, imports them only inside the
`kernels` fixture, and reloads them there if some earlier import made compiled kernels
(harmless otherwise: the flag changes nothing for code already imported).

MTPKIT_TRITON_TEST_DEVICE=cuda runs the same tests natively on a GPU (no interpreter); the
GPU check script (benchmarks/gpu_kernels.py) does that before it times the kernels.

Every verify call covers all accepted counts at once: a batch has one row per
prev_num_emitted in 1..bundle plus padded rows (every slot the null slot 0 / block-table row of
the null block, seq_len = bundle, prev_num_emitted 1), with real rows' slots and blocks
shuffled through the pool. The null slot / block holds random (finite) data: outputs of
all rows, padded ones included, must equal the reference's. The kernels never write the
null slot (the reference does), so slot 0 is compared with its value before the call.
Inputs are strided views like the model's (q/k/v split from one projection).
"""

import importlib
import inspect
import os

DEVICE = "cuda" if os.environ.get("MTPKIT_TRITON_TEST_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before mtpkit.kernels.triton_* is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from mtpkit.kernels import conv as conv_ref  # noqa: E402
from mtpkit.kernels import gdn as gdn_ref  # noqa: E402
from mtpkit.kernels import paged as paged_ref  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("MTPKIT_TRITON_TEST_DEVICE=cuda but CUDA is not available", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
BUNDLES = [1, 2, 3, 4]


def out_tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def kernels():
    """(triton_gdn, triton_conv, triton_paged), interpreted on CPU."""
    from triton.runtime.interpreter import InterpretedFunction

    mods = [importlib.import_module(f"mtpkit.kernels.triton_{n}") for n in ("gdn", "conv", "paged")]
    if DEVICE == "cpu" and not isinstance(mods[0]._gdn_verify_kernel, InterpretedFunction):
        mods = [importlib.reload(m) for m in mods]  # decorated before TRITON_INTERPRET was set
        importlib.reload(importlib.import_module("mtpkit.kernels.triton_ops"))
    assert (DEVICE == "cuda") != isinstance(mods[0]._gdn_verify_kernel, InterpretedFunction)
    return mods


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------
# GDN


def gdn_inputs(g, lead, hk, hv, dk, dv, dtype):
    """q, k, v as strided views of one [.., 2*hk*dk + hv*dv] projection (like the model);
    a, b; A_log, dt_bias (parameters, fp32 like the loaded model's)."""
    mixed = randn(g, *lead, 2 * hk * dk + hv * dv, dtype=dtype)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    a, b = randn(g, *lead, hv, dtype=dtype), randn(g, *lead, hv, dtype=dtype)
    A_log = torch.log(torch.rand(hv, generator=g) * 4 + 0.5).to(DEVICE)
    dt_bias = randn(g, hv)
    return q, k, v, a, b, A_log, dt_bias


def verify_rows(g, bundle, n_pad, num_slots_extra=3):
    """state_slots [R, bundle] (real rows: distinct shuffled slots; padded rows: 0) and
    prev_num_emitted [R] (1..bundle for the real rows, 1 for padded ones)."""
    R = bundle + n_pad
    perm = torch.randperm(bundle * bundle + num_slots_extra, generator=g) + 1
    slots = torch.zeros(R, bundle, dtype=torch.int64)
    slots[:bundle] = perm[: bundle * bundle].view(bundle, bundle)
    acc = torch.ones(R, dtype=torch.int64)
    acc[:bundle] = torch.arange(1, bundle + 1, device=acc.device)
    return slots.to(DEVICE), acc.to(DEVICE), 1 + bundle * bundle + num_slots_extra


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 8), (1, 2, 8, 16), (1, 4, 32, 32)])
@pytest.mark.parametrize("bundle", BUNDLES)
def test_gdn_verify(kernels, bundle, hk, hv, dk, dv, dtype):
    tg = kernels[0]
    g = gen(100 * bundle + hv + dk)
    slots, acc, num_slots = verify_rows(g, bundle, n_pad=2)
    R = slots.shape[0]
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(g, (R, bundle), hk, hv, dk, dv, dtype)
    pool = randn(g, num_slots, hv, dk, dv)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = gdn_ref.gated_delta_rule_verify(q, k, v, a, b, A_log, dt_bias, p_ref, slots, acc)
    o_tri = tg.gated_delta_rule_verify(q, k, v, a, b, A_log, dt_bias, p_tri, slots, acc)
    assert o_tri.dtype == v.dtype and o_tri.shape == o_ref.shape
    torch.testing.assert_close(o_tri, o_ref, **out_tol(dtype))  # padded rows included
    torch.testing.assert_close(p_tri[1:], p_ref[1:], atol=2e-5, rtol=2e-5)
    assert torch.equal(p_tri[0], pool[0])  # the null slot is never written


def test_gdn_verify_real_head_dims(kernels):
    """Qwen3-Next's head dims (dk = dv = 128), GQA 2, bundle 3, one padded row."""
    tg = kernels[0]
    g = gen(7)
    slots, acc, num_slots = verify_rows(g, 3, n_pad=1)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(g, (4, 3), 1, 2, 128, 128, torch.bfloat16)
    pool = randn(g, num_slots, 2, 128, 128)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = gdn_ref.gated_delta_rule_verify(q, k, v, a, b, A_log, dt_bias, p_ref, slots, acc)
    o_tri = tg.gated_delta_rule_verify(q, k, v, a, b, A_log, dt_bias, p_tri, slots, acc)
    torch.testing.assert_close(o_tri, o_ref, **out_tol(torch.bfloat16))
    torch.testing.assert_close(p_tri[1:], p_ref[1:], atol=1e-4, rtol=1e-4)


def test_gdn_verify_chain_equals_prefill(kernels):
    """Two chained verify steps (the second reading the state the first wrote at offset
    a-1) equal one prefill over the accepted tokens."""
    tg = kernels[0]
    g = gen(11)
    B, hk, hv, dk, dv = 3, 1, 2, 16, 16
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(g, (2, 1, B), hk, hv, dk, dv, torch.float32)
    pool = torch.zeros(1 + B, hv, dk, dv, device=DEVICE)
    slots = torch.arange(1, 1 + B, device=DEVICE)[None]
    o1 = tg.gated_delta_rule_verify(q[0], k[0], v[0], a[0], b[0], A_log, dt_bias, pool, slots,
                                    torch.tensor([1], device=DEVICE))
    accepted = 2
    o2 = tg.gated_delta_rule_verify(q[1], k[1], v[1], a[1], b[1], A_log, dt_bias, pool, slots,
                                    torch.tensor([accepted], device=DEVICE))
    # the same history through the reference prefill: step 1's first `accepted` tokens, step 2
    cat = lambda x: torch.cat([x[0, 0, :accepted], x[1, 0]])  # noqa: E731
    ref_pool = torch.zeros(2, hv, dk, dv, device=DEVICE)
    T = accepted + B
    o = gdn_ref.gated_delta_rule_prefill(
        cat(q), cat(k), cat(v), cat(a), cat(b), A_log, dt_bias, ref_pool,
        torch.tensor([0, T], device=DEVICE), torch.tensor([1], device=DEVICE),
        torch.tensor([1], device=DEVICE), torch.tensor([False], device=DEVICE))
    torch.testing.assert_close(o1[0, :accepted], o[:accepted], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(o2[0], o[accepted:], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool[B], ref_pool[1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 8), (1, 4, 8, 16)])
def test_gdn_prefill(kernels, hk, hv, dk, dv, dtype):
    tg = kernels[0]
    g = gen(hv + dk)
    lens = [7, 0, 12, 1]
    T = sum(lens)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(g, (T,), hk, hv, dk, dv, dtype)
    pool = randn(g, 7, hv, dk, dv)
    qsl = torch.tensor([0] + lens, device=DEVICE).cumsum(0)
    # request 0 reads 1 writes 2; request 1 (empty) reads 3 writes 3; request 2 has no initial
    # state and a nominal read slot 2 = request 0's write slot; request 3 reads 5 writes 6.
    read = torch.tensor([1, 3, 2, 5], device=DEVICE)
    write = torch.tensor([2, 3, 4, 6], device=DEVICE)
    has_init = torch.tensor([True, True, False, True], device=DEVICE)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = gdn_ref.gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, p_ref, qsl, read, write,
                                             has_init, chunk_size=4)
    o_tri = tg.gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, p_tri, qsl, read, write,
                                        has_init, chunk_size=4)
    assert o_tri.dtype == v.dtype
    torch.testing.assert_close(o_tri, o_ref, **out_tol(dtype))
    torch.testing.assert_close(p_tri, p_ref, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------
# conv


def conv_pool_dtype(dtype):
    return dtype  # the engine keeps conv states in the model dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C,W,extra", [(10, 4, 0), (200, 4, 1), (12, 2, 0)])
@pytest.mark.parametrize("bundle", BUNDLES)
def test_conv_verify(kernels, bundle, C, W, extra, dtype):
    tc = kernels[1]
    g = gen(10 * bundle + C + W)
    L = W - 1 + bundle - 1 + extra
    R = bundle + 2
    x = randn(g, R, bundle, 2 * C, dtype=dtype)[..., ::2]  # strided, like a split
    weight = randn(g, C, W, dtype=dtype)
    pool = randn(g, R + 3, C, L, dtype=conv_pool_dtype(dtype))
    slots = (torch.randperm(R + 2, generator=g)[:R] + 1).to(DEVICE)
    slots[bundle:] = 0
    acc = torch.ones(R, dtype=torch.int64, device=DEVICE)
    acc[:bundle] = torch.arange(1, bundle + 1, device=acc.device)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = conv_ref.causal_conv1d_verify(x, weight, p_ref, slots, acc)
    o_tri = tc.causal_conv1d_verify(x, weight, p_tri, slots, acc)
    assert o_tri.dtype == x.dtype
    torch.testing.assert_close(o_tri, o_ref, **out_tol(dtype))
    assert torch.equal(p_tri[1:], p_ref[1:])  # states are copies of inputs: exact
    assert torch.equal(p_tri[0], pool[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_spec", [0, 2])
@pytest.mark.parametrize("C,W", [(10, 4), (150, 3)])
def test_conv_prefill(kernels, C, W, num_spec, dtype):
    tc = kernels[1]
    g = gen(C + W + num_spec)
    lens = [9, 0, 2, 5, 1]  # an empty request, requests shorter than the window
    L = W - 1 + num_spec
    x = randn(g, sum(lens), 2 * C, dtype=dtype)[:, C:]
    weight = randn(g, C, W, dtype=dtype)
    pool = randn(g, 7, C, L, dtype=conv_pool_dtype(dtype))
    qsl = torch.tensor([0] + lens, device=DEVICE).cumsum(0)
    slots = torch.tensor([3, 1, 4, 6, 2], device=DEVICE)
    has_init = torch.tensor([True, True, False, True, False], device=DEVICE)
    p_ref, p_tri = pool.clone(), pool.clone()
    o_ref = conv_ref.causal_conv1d_prefill(x, weight, p_ref, qsl, slots, has_init)
    o_tri = tc.causal_conv1d_prefill(x, weight, p_tri, qsl, slots, has_init)
    torch.testing.assert_close(o_tri, o_ref, **out_tol(dtype))
    assert torch.equal(p_tri, p_ref)


def _snapshots(rows, positions, qsl):
    """StateSnapshots after position p of row r (ids in order)."""
    from mtpkit.step.metadata import StateSnapshots

    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)
    return StateSnapshots(rows=t(rows), token_index=t([int(qsl[r]) + p for r, p in zip(rows, positions)]),
                          ids=t(list(range(len(rows)))[::-1]))


def test_gdn_prefill_snapshots(kernels):
    """State snapshots (tests/test_state_snapshots.py): the Triton prefill stores the state
    after each requested token, equal to the reference's (which equals the recurrence up to
    that token); the rest of the store is untouched; the slots are as without snapshots."""
    tg = kernels[0]
    g = gen(29)
    lens, hk, hv, dk, dv = [21, 6, 13], 1, 2, 16, 8
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(g, (sum(lens),), hk, hv, dk, dv, torch.float32)
    pool = randn(g, 5, hv, dk, dv)
    qsl = torch.tensor([0] + lens, device=DEVICE).cumsum(0)
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    has_init = torch.tensor([True, False, True], device=DEVICE)
    snaps = _snapshots([0, 0, 0, 1, 2], [0, 7, 20, 3, 12], qsl)
    store = {n: torch.full((7, hv, dk, dv), float("nan"), device=DEVICE) for n in ("ref", "tri")}
    p_ref, p_tri, p_plain = pool.clone(), pool.clone(), pool.clone()
    o_ref = gdn_ref.gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, p_ref, qsl, slots, slots, has_init,
                                             snapshots=snaps, snapshot_state=store["ref"])
    o_tri = tg.gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, p_tri, qsl, slots, slots, has_init,
                                        snapshots=snaps, snapshot_state=store["tri"])
    tg.gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, p_plain, qsl, slots, slots, has_init)
    torch.testing.assert_close(o_tri, o_ref, **out_tol(torch.float32))
    torch.testing.assert_close(store["tri"][:5], store["ref"][:5], atol=2e-5, rtol=2e-5)
    assert torch.isnan(store["tri"][5:]).all()
    assert torch.equal(p_tri, p_plain)


@pytest.mark.parametrize("num_spec", [0, 2])
def test_conv_prefill_snapshots(kernels, num_spec):
    """The Triton conv prefill's snapshots equal the reference's, window columns included."""
    tc = kernels[1]
    g = gen(31 + num_spec)
    C, W, lens = 10, 4, [9, 2, 5]
    L = W - 1 + num_spec
    x = randn(g, sum(lens), 2 * C)[:, C:]
    weight = randn(g, C, W)
    pool = randn(g, 5, C, L)
    qsl = torch.tensor([0] + lens, device=DEVICE).cumsum(0)
    slots = torch.tensor([3, 1, 4], device=DEVICE)
    has_init = torch.tensor([True, False, True], device=DEVICE)
    snaps = _snapshots([0, 0, 0, 1, 2, 2], [0, 1, 8, 1, 0, 4], qsl)
    store = {n: torch.full((6, C, L), float("nan"), device=DEVICE) for n in ("ref", "tri")}
    p_ref, p_tri = pool.clone(), pool.clone()
    conv_ref.causal_conv1d_prefill(x, weight, p_ref, qsl, slots, has_init, snaps, store["ref"])
    tc.causal_conv1d_prefill(x, weight, p_tri, qsl, slots, has_init, snaps, store["tri"])
    assert torch.equal(store["tri"], store["ref"])      # copies of inputs: exact
    assert torch.equal(p_tri, p_ref)


# ---------------------------------------------------------------------------------------
# paged attention


def kv_pool(g, num_blocks, page, kvh, D, dtype):
    return randn(g, num_blocks, page, kvh, D, dtype=dtype), randn(g, num_blocks, page, kvh, D, dtype=dtype)


def block_table(g, seq_lens, page, max_blocks, num_blocks):
    """Shuffled distinct blocks for every row with seq_len > 0 that is not padding; padded
    rows (marked by seq_len < 0 in the input) get the null block row."""
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for i, n in enumerate(seq_lens):
        if n > 0:
            nb = -(-n // page)
            table[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    return table.to(DEVICE)


# (heads, kv_heads, head_dim, page, sliding_window, softcap, splits)
VERIFY_CASES = [
    (2, 2, 16, 4, None, None, 1),
    (4, 2, 64, 16, None, 30.0, 2),
    (8, 2, 24, 4, 6, None, 3),
    (4, 1, 512, 8, 9, 20.0, 2),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: "h{}kv{}d{}p{}w{}c{}s{}".format(*c))
@pytest.mark.parametrize("bundle", BUNDLES)
def test_paged_verify(kernels, bundle, case, dtype, monkeypatch):
    tp = kernels[2]
    H, KVH, D, page, window, cap, splits = case
    monkeypatch.setattr(tp, "SPLITS_OVERRIDE", splits)
    g = gen(bundle * 31 + D + H)
    lens = [bundle, bundle + 1, 2 * page + bundle + 3, 5 * page - 1]  # real rows; then 2 padded
    max_blocks = 6
    num_blocks = 1 + sum(-(-n // page) for n in lens) + 2
    table = block_table(g, lens + [0, 0], page, max_blocks, num_blocks)
    seq_lens = torch.tensor(lens + [bundle, bundle], device=DEVICE)
    k_cache, v_cache = kv_pool(g, num_blocks, page, KVH, D, dtype)
    q = randn(g, len(lens) + 2, bundle, H, 2 * D, dtype=dtype)[..., :D]  # strided (q | gate)
    # max_seq_len: the host-side bound the engine passes (tight, loose), or none
    max_seq_len = [None, max(lens), max(lens) + 5, None][bundle - 1]
    args = (q, k_cache, v_cache, seq_lens, table, D ** -0.5, window, cap, max_seq_len)
    o_ref = paged_ref.paged_attention_verify(*args)
    o_tri = tp.paged_attention_verify(*args)
    assert o_tri.dtype == dtype and o_tri.shape == o_ref.shape
    torch.testing.assert_close(o_tri, o_ref, **out_tol(dtype))


# (heads, kv_heads, head_dim, page, sliding_window, softcap)
PREFILL_CASES = [
    (2, 2, 16, 4, None, None),
    (4, 2, 32, 8, 5, None),
    (4, 1, 64, 16, None, 25.0),
    (2, 1, 512, 4, 7, 15.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "h{}kv{}d{}p{}w{}c{}".format(*c))
def test_paged_prefill(kernels, case, dtype):
    tp = kernels[2]
    H, KVH, D, page, window, cap = case
    g = gen(D + H + page)
    q_lens = [9, 0, 40, 3]       # a request with no new tokens; one longer than BLOCK_M
    ctx = [9, 4, 45, 3 + 2 * page]  # fresh prompt, cached only, chunk after prefix, ...
    max_blocks = max(-(-n // page) for n in ctx)
    num_blocks = 1 + sum(-(-n // page) for n in ctx) + 1
    table = block_table(g, ctx, page, max_blocks, num_blocks)
    k_cache, v_cache = kv_pool(g, num_blocks, page, KVH, D, dtype)
    q = randn(g, sum(q_lens), H, D, dtype=dtype)
    qsl = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0)
    args = (q, k_cache, v_cache, qsl, torch.tensor(ctx, device=DEVICE), table, D ** -0.5, window, cap)
    o_ref = paged_ref.paged_attention_prefill(*args)
    o_tri = tp.paged_attention_prefill(*args)
    torch.testing.assert_close(o_tri, o_ref, **out_tol(dtype))


def test_num_splits_depends_on_shapes_only(kernels):
    tp = kernels[2]
    cpu = torch.device("cpu")
    assert tp.num_splits(64, 2, 4096, cpu) == 1          # enough programs already
    assert tp.num_splits(1, 2, 100, cpu) == 1            # too short to split
    assert 1 < tp.num_splits(1, 2, 4096, cpu) <= tp.MAX_SPLITS


# ---------------------------------------------------------------------------------------
# backend wiring


def test_entry_points_match_reference_signatures(kernels):
    tg, tc, tp = kernels
    pairs = [(tg.gated_delta_rule_verify, gdn_ref.gated_delta_rule_verify),
             (tg.gated_delta_rule_prefill, gdn_ref.gated_delta_rule_prefill),
             (tc.causal_conv1d_verify, conv_ref.causal_conv1d_verify),
             (tc.causal_conv1d_prefill, conv_ref.causal_conv1d_prefill),
             (tp.paged_attention_verify, paged_ref.paged_attention_verify),
             (tp.paged_attention_prefill, paged_ref.paged_attention_prefill)]
    for tri, ref in pairs:
        assert getattr(tri, "__mtpkit_checked__", False), tri.__name__
        # jaxtyping makes a new annotation class per subscription: compare their text
        assert str(inspect.signature(tri)) == str(inspect.signature(ref)), tri.__name__


# Each torch reference module of kernels/ and its Triton module (ops.py's table).
TRITON_MODULE = {"paged": "triton_paged", "gdn": "triton_gdn", "conv": "triton_conv", "moe_experts": "triton_moe",
                 "elementwise": "triton_elementwise", "fp8_matmul": "triton_fp8_matmul"}


def test_every_op_is_a_triton_kernel_beside_its_reference(kernels):
    """One selector, one fallback rule: every kernel field of Ops (the FP8 matmuls and the glue
    included) is, in the "triton" backend, the function of the same name and signature in the
    Triton module beside the torch backend's reference, and decides by use_reference."""
    import dataclasses

    from mtpkit.kernels.ops import TORCH, Ops
    from mtpkit.kernels.triton_ops import TRITON

    kernel_fields = [f.name for f in dataclasses.fields(Ops) if callable(getattr(TORCH, f.name))]
    assert {"fp8_linear", "fp8_batched", "moe_experts", "act_mul"} <= set(kernel_fields)
    for name in kernel_fields:
        ref, tri = getattr(TORCH, name), getattr(TRITON, name)
        if tri is None or tri is ref:  # verify_gather (the kernel walks the table), write_kv
            continue
        assert ref.__name__ == tri.__name__ == name
        assert tri.__module__ == "mtpkit.kernels." + TRITON_MODULE[ref.__module__.rsplit(".", 1)[1]], name
        assert str(inspect.signature(tri)) == str(inspect.signature(ref)), name
        assert "use_reference(__name__, " in inspect.getsource(tri), name


def test_select_backend(kernels, monkeypatch):
    from mtpkit.kernels.ops import select_ops

    monkeypatch.delenv("MTPKIT_ATTN_BACKEND", raising=False)
    tri = select_ops(torch.device(DEVICE), "triton")
    assert tri.name == "triton"
    assert tri.gated_delta_rule_verify is kernels[0].gated_delta_rule_verify
    assert select_ops(torch.device("cpu")).name == "torch"      # CPU default
    assert select_ops(torch.device(DEVICE), "torch").name == "torch"
    monkeypatch.setenv("MTPKIT_ATTN_BACKEND", "triton")
    assert select_ops(torch.device("cpu")).name == "triton"


def test_checked_in_debug_mode(kernels):
    """The annotations hold for real calls (shape checking on)."""
    import mtpkit

    tc = kernels[1]
    g = gen(3)
    x, w = randn(g, 2, 2, 6), randn(g, 6, 3)
    pool = randn(g, 3, 6, 3)
    with mtpkit.debug() as trace:
        tc.causal_conv1d_verify(x, w, pool, torch.tensor([1, 2], device=DEVICE),
                                torch.tensor([2, 1], device=DEVICE))
    assert trace.entries[-1].dims["bundle"] == 2


def test_triton_backend_refused_without_cuda_or_interpreter(kernels, monkeypatch):
    from mtpkit.kernels import triton_ops as triton_backend
    from mtpkit.errors import ConfigError

    monkeypatch.setattr(triton_backend, "_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="attn_backend='torch'"):
        triton_backend.make_triton_ops()


# ---- block-scaled FP8 matmul (mtpkit/kernels/triton_fp8_matmul.py vs fp8_matmul.py) ----------


@pytest.fixture(scope="module")
def fp8_kernel():
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module("mtpkit.kernels.triton_fp8_matmul")
    if DEVICE == "cpu" and not isinstance(mod._fp8_block_matmul_kernel, InterpretedFunction):
        mod = importlib.reload(mod)  # decorated before TRITON_INTERPRET was set
    assert (DEVICE == "cuda") != isinstance(mod._fp8_block_matmul_kernel, InterpretedFunction)
    return mod


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,block", [(1, 256, 384, (128, 128)),     # decode: one token, whole blocks
                                         (70, 200, 130, (128, 128)),    # partial blocks on both dims, BM tail
                                         (5, 96, 80, (32, 16))])        # several small blocks
def test_fp8_block_matmul(fp8_kernel, m, n, k, block, dtype):
    from mtpkit.kernels import fp8_matmul as ref

    g = gen(11)
    w = randn(g, n, k) * 0.1
    wq, ws = ref.quantize(w, block)
    x = randn(g, m, k).to(dtype)
    xq, xs = ref.quantize_activation(x, block[1])
    # the scales matter: a kernel reading the wrong block's scale is off by whole factors
    ws = ws * (1 + torch.arange(ws.numel(), device=DEVICE).view(ws.shape) % 3)
    got = fp8_kernel.fp8_block_matmul(xq, xs, wq, ws, block, dtype)
    want = ref.fp8_block_matmul(xq, xs, wq, ws, block, dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), **out_tol(dtype))
    # the entry point used by the linear layers: activation quantized, any leading dims
    y = fp8_kernel.fp8_linear(x.view(1, m, k), wq, ws, block)
    torch.testing.assert_close(y.float(), ref.fp8_linear(x.view(1, m, k), wq, ws, block).float(),
                               **out_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,block", [(1, 192, 256, (128, 128)),    # decode row, a partial row block
                                         (20, 96, 80, (32, 16))])       # BM 64 tail; several small blocks
def test_fp8_block_matmul_named_scale_rows(fp8_kernel, m, n, k, block, dtype):
    """A merged weight whose parts cut blocks: every row names its scale row (any order)."""
    from mtpkit.kernels import fp8_matmul as ref

    g = gen(12)
    wq, ws = ref.quantize(randn(g, n, k) * 0.1, block)
    ws = torch.cat([ws, ws * 2, ws * 3])                       # a table of 3x the block rows
    rows = torch.randint(0, ws.shape[0], (n,), generator=g, device=DEVICE).to(torch.int32)
    xq, xs = ref.quantize_activation(randn(g, m, k).to(dtype), block[1])
    got = fp8_kernel.fp8_block_matmul(xq, xs, wq, ws, block, dtype, rows)
    want = ref.fp8_block_matmul(xq, xs, wq, ws, block, dtype, rows)
    torch.testing.assert_close(got.float(), want.float(), **out_tol(dtype))
    # not the block layout's scales: a kernel ignoring the index is off by whole factors
    assert (ref.fp8_block_matmul(xq, xs, wq, ws, block, dtype) - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gather", [True, False])
def test_fp8_batched_matmul(fp8_kernel, gather, dtype):
    """The MoE's products: each token-expert pair's expert gathered by index (one row each),
    or every expert of a stack over the same rows (x broadcast, stride 0); experts whose
    [2I, H] rows name their scale rows (gate and up cutting a block) in the gathered case."""
    from mtpkit.kernels import fp8_matmul as ref

    g = gen(13)
    E, N, K, block = 5, 160, 256, (128, 128)
    wq, ws = ref.quantize(randn(g, E, N, K) * 0.1, block)
    ws = ws * (1 + torch.arange(ws.numel(), device=DEVICE).view(ws.shape) % 3)
    if gather:
        experts = torch.tensor([3, 0, 3, 4, 1, 1, 2], device=DEVICE)
        rows = (torch.arange(N, device=DEVICE) // 80).to(torch.int32)   # two parts of 80 rows
        x = randn(g, len(experts), 1, K).to(dtype)
    else:
        experts, rows = None, None
        x = randn(g, 1, 9, K).to(dtype).expand(E, 9, K)
    xq, xs = ref.quantize_activation(x.reshape(-1, K), block[1])
    xq, xs = xq.view(*x.shape), xs.view(*x.shape[:2], -1)
    for out_dtype in (dtype, torch.float32):
        got = fp8_kernel.fp8_batched_matmul(xq, xs, wq, ws, block, out_dtype, experts, rows)
        want = ref.fp8_batched_matmul(xq, xs, wq, ws, block, out_dtype, experts, rows)
        assert got.dtype == out_dtype and got.shape == (x.shape[0], x.shape[1], N)
        torch.testing.assert_close(got.float(), want.float(), **out_tol(dtype))
