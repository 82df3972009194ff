"""The pure-torch gated delta rule references: chunked == recurrent, the prefill and verify
entry points against the recurrent core, against transformers' oracle, and the
speculative state contract (read slot a-1, write slot t)."""

import pytest
import torch
import torch.nn.functional as F

from mtpkit import shapes
from mtpkit.kernels.gdn import (gated_delta_rule_prefill, gated_delta_rule_verify, gdn_chunked_core, gdn_prepare,
                                gdn_recurrent_core)

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}


def core_inputs(T, H=3, dk=8, dv=6, dtype=torch.float32, seed=0, decay=1.0):
    """Prepared inputs shaped like the real ones: unit k, scaled unit q, g <= 0, beta in (0,1)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(r(T, H, dk), dim=-1) * dk ** -0.5
    k = F.normalize(r(T, H, dk), dim=-1)
    g = -decay * F.softplus(r(T, H))
    beta = torch.sigmoid(r(T, H))
    return [x.to(dtype) for x in (q, k, r(T, H, dv), g, beta, r(H, dk, dv))]


def raw_inputs(T, hk, hv, dk=8, dv=6, dtype=torch.float32, seed=0, lead=()):
    """Unprepared layer inputs (q, k, v, a, b) and parameters (A_log, dt_bias)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*lead, *s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    A_log = torch.log(torch.rand(hv, generator=gen, dtype=torch.float64) * 4 + 0.5).to(dtype)
    dt_bias = torch.randn(hv, generator=gen, dtype=torch.float64).to(dtype)
    return r(T, hk, dk), r(T, hk, dk), r(T, hv, dv), r(T, hv), r(T, hv), A_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, chunk_size, dtype, with_state):
    q, k, v, g, beta, s0 = core_inputs(T, dtype=dtype, seed=T)
    if not with_state:
        s0 = torch.zeros_like(s0)
    o1, s1 = gdn_recurrent_core(q, k, v, g, beta, s0)
    o2, s2 = gdn_chunked_core(q, k, v, g, beta, s0, chunk_size=chunk_size)
    assert o1.dtype == o2.dtype == s1.dtype == s2.dtype == dtype
    torch.testing.assert_close(o2, o1, **TOL[dtype])
    torch.testing.assert_close(s2, s1, **TOL[dtype])


@pytest.mark.parametrize("decay", [0.0, 30.0])
def test_chunked_extreme_decay(decay):
    # No decay at all, and decay strong enough that exp(cumsum) underflows inside a chunk:
    # the chunked form must stay finite and exact.
    q, k, v, g, beta, s0 = core_inputs(100, dtype=torch.float64, decay=decay)
    o1, s1 = gdn_recurrent_core(q, k, v, g, beta, s0)
    o2, s2 = gdn_chunked_core(q, k, v, g, beta, s0, chunk_size=32)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    torch.testing.assert_close(o2, o1, **TOL[torch.float64])
    torch.testing.assert_close(s2, s1, **TOL[torch.float64])


def test_recurrent_matches_definition():
    # One token by hand, straight from the formula in kernels/gdn.py's docstring.
    q, k, v, g, beta, s0 = core_inputs(1, H=1, dtype=torch.float64)
    S = torch.exp(g[0, 0]) * s0[0]
    S = S + torch.outer(k[0, 0], beta[0, 0] * (v[0, 0] - k[0, 0] @ S))
    o, s = gdn_recurrent_core(q, k, v, g, beta, s0)
    torch.testing.assert_close(s[0], S, atol=1e-14, rtol=0)
    torch.testing.assert_close(o[0, 0], q[0, 0] @ S, atol=1e-14, rtol=0)


def test_prepare_matches_transformers_formulas():
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm
    q, k, _, a, b, A_log, dt_bias = raw_inputs(7, 2, 4, dtype=torch.float64)
    qp, kp, g, beta = gdn_prepare(q, k, a, b, A_log, dt_bias, dtype=torch.float64)
    torch.testing.assert_close(qp, l2norm(q).repeat_interleave(2, 1) * 8 ** -0.5)
    torch.testing.assert_close(kp, l2norm(k).repeat_interleave(2, 1))
    torch.testing.assert_close(beta, b.sigmoid())
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    assert gdn_prepare(q.bfloat16(), k.bfloat16(), a, b, A_log, dt_bias)[0].dtype == torch.float32


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_prefill_matches_transformers_oracle(hk, hv):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    T = 70
    q, k, v, a, b, A_log, dt_bias = raw_inputs(T, hk, hv, seed=3)
    s0 = torch.randn(hv, 8, 6)
    pool = torch.zeros(3, hv, 8, 6)
    pool[1] = s0
    qsl, one = torch.tensor([0, T]), torch.tensor([1])
    out = gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, pool, qsl, one, torch.tensor([2]),
                                   torch.tensor([True]))
    g = -A_log.exp() * F.softplus(a + dt_bias)
    ref, ref_s = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], b.sigmoid()[None],
                                              initial_state=s0[None], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2], ref_s[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], s0, atol=0, rtol=0)


def _prefill(q, k, v, a, b, A_log, dt_bias, pool, lens, read, write, has_init, chunk_size=16):
    qsl = torch.tensor([0] + lens).cumsum(0)
    return gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, pool, qsl, torch.tensor(read),
                                    torch.tensor(write), torch.tensor(has_init),
                                    chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_prefill_varlen_equals_each_alone(dtype, hk, hv):
    lens = [37, 20]
    q, k, v, a, b, A_log, dt_bias = raw_inputs(sum(lens), hk, hv, dtype=dtype, seed=1)
    pool_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    pool = torch.randn(6, hv, 8, 6, dtype=pool_dtype)
    before = pool.clone()
    # Request 0 reads slot 1 and writes slot 2; request 1 has no initial state (its read
    # slot is garbage and must be ignored) and writes slot 4. Request 0's write slot is
    # request 1's nominal read slot: reads happen before writes.
    out = _prefill(q, k, v, a, b, A_log, dt_bias, pool, lens, [1, 2], [2, 4], [True, False])
    assert out.dtype == dtype and pool.dtype == pool_dtype
    alone = pool_dtype
    out_tol = TOL[dtype] if dtype != torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
    for i, (sl, rd, wr, init) in enumerate([(slice(0, 37), 1, 2, True), (slice(37, 57), 2, 4, False)]):
        p = before.clone()
        if not init:
            p[rd] = float("nan")  # must never be read
        o = _prefill(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, p, [sl.stop - sl.start],
                     [rd], [wr], [init])
        # Not bitwise: matmul rounding may depend on where a slice starts in memory.
        torch.testing.assert_close(out[sl], o, **out_tol)
        torch.testing.assert_close(pool[wr], p[wr], **TOL[pool_dtype])
        assert pool[wr].dtype == alone
    for s in (0, 1, 3, 5):
        torch.testing.assert_close(pool[s], before[s], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_prefill_in_chunks_equals_one_shot(dtype, hk, hv):
    T = 100
    q, k, v, a, b, A_log, dt_bias = raw_inputs(T, hk, hv, dtype=dtype, seed=2)
    pool = torch.zeros(3, hv, 8, 6, dtype=dtype)
    one = _prefill(q, k, v, a, b, A_log, dt_bias, pool, [T], [0], [1], [False])
    pool2 = torch.zeros_like(pool)
    outs = []
    cuts = [0, 1, 7, 64, 70, 100]
    for j, (s, e) in enumerate(zip(cuts, cuts[1:])):
        # The state travels through slot 2 between chunks, as the engine's chunked prefill.
        outs.append(_prefill(q[s:e], k[s:e], v[s:e], a[s:e], b[s:e], A_log, dt_bias, pool2,
                             [e - s], [2], [2], [j > 0]))
    torch.testing.assert_close(torch.cat(outs), one, **TOL[dtype])
    torch.testing.assert_close(pool2[2], pool[1], **TOL[dtype])


def test_prefill_bf16_computes_in_fp32():
    q, k, v, a, b, A_log, dt_bias = raw_inputs(40, 2, 4, dtype=torch.bfloat16, seed=4)
    pool, pool32 = torch.zeros(2, 4, 8, 6), torch.zeros(2, 4, 8, 6)
    out = _prefill(q, k, v, a, b, A_log, dt_bias, pool, [40], [0], [1], [False])
    ref = _prefill(*(x.float() for x in (q, k, v, a, b, A_log, dt_bias)), pool32, [40], [0], [1], [False])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(pool, pool32, atol=0, rtol=0)


def _verify_setup(bundle, dtype, hk=2, hv=4, seed=0):
    """bundle real requests (request i has prev_num_emitted i+1) plus one padded row."""
    R = bundle + 1
    q, k, v, a, b, A_log, dt_bias = raw_inputs(bundle, hk, hv, dtype=dtype, seed=seed, lead=(R,))
    num_slots = 1 + bundle * bundle + 2  # null slot, bundle slots per request, two spare
    pool_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    pool = torch.randn(num_slots, hv, 8, 6, dtype=pool_dtype)
    slots = torch.zeros(R, bundle, dtype=torch.long)
    perm = torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(seed))[:bundle * bundle] + 1
    slots[:bundle] = perm.view(bundle, bundle)  # non-contiguous, shuffled slot ids
    prev_num_emitted = torch.tensor(list(range(1, bundle + 1)) + [1])
    return (q, k, v, a, b, A_log, dt_bias, pool, slots, prev_num_emitted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bundle", [1, 2, 3, 4])
def test_verify_reads_slot_a_minus_1_and_writes_every_position(bundle, dtype):
    q, k, v, a, b, A_log, dt_bias, pool, slots, prev_num_emitted = _verify_setup(bundle, dtype)
    before = pool.clone()
    out = gated_delta_rule_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, prev_num_emitted)
    assert out.dtype == dtype and out.shape == v.shape
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    tol = TOL[cd] if dtype != torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
    for i in range(bundle):
        n_acc = int(prev_num_emitted[i])
        qp, kp, g, beta = gdn_prepare(q[i], k[i], a[i], b[i], A_log, dt_bias, dtype=cd)
        init = before[slots[i, n_acc - 1]].to(cd)
        o_ref = []
        for t in range(bundle):  # the state after each position, one token at a time
            o_t, init = gdn_recurrent_core(qp[t:t + 1], kp[t:t + 1], v[i, t:t + 1], g[t:t + 1],
                                           beta[t:t + 1], init)
            o_ref.append(o_t)
            torch.testing.assert_close(pool[slots[i, t]], init.to(pool.dtype), **TOL[cd])
        torch.testing.assert_close(out[i], torch.cat(o_ref).to(dtype), **tol)
    # The padded row computes finite values and writes nothing but the null slot.
    assert torch.isfinite(out[bundle]).all() and torch.isfinite(pool[0]).all()
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots.flatten()] = False
    torch.testing.assert_close(pool[untouched], before[untouched], atol=0, rtol=0)


def test_verify_all_rows_padded_and_null_slot_stays_finite():
    q, k, v, a, b, A_log, dt_bias = raw_inputs(3, 2, 4, seed=9, lead=(4,))
    pool = torch.zeros(5, 4, 8, 6)
    pool[1:] = torch.randn(4, 4, 8, 6)
    before = pool.clone()
    for _ in range(3):  # repeated padded steps keep feeding the null slot its own output
        out = gated_delta_rule_verify(q, k, v, a, b, A_log, dt_bias, pool,
                                      torch.zeros(4, 3, dtype=torch.long), torch.ones(4, dtype=torch.long))
        assert torch.isfinite(out).all() and torch.isfinite(pool[0]).all()
    torch.testing.assert_close(pool[1:], before[1:], atol=0, rtol=0)


@pytest.mark.parametrize("accepted", [[1, 1], [2, 3], [3, 1], [3, 3, 2]])
def test_spec_steps_equal_non_speculative_prefill(accepted):
    """Prefill, then verify steps accepting a tokens each: the state the next step reads
    equals prefill over exactly the accepted tokens (fp64, so 1e-12)."""
    bundle, hk, hv, dt = 3, 2, 4, torch.float64
    n = 20 + bundle * (len(accepted) + 1)
    q, k, v, a, b, A_log, dt_bias = raw_inputs(n, hk, hv, dtype=dt, seed=5)
    pool = torch.zeros(1 + bundle, hv, 8, 6, dtype=dt)
    slots = torch.arange(1, bundle + 1)[None]
    # After a prefill the state sits where a step that accepted everything would leave it.
    _prefill(q[:20], k[:20], v[:20], a[:20], b[:20], A_log, dt_bias, pool, [20], [0],
             [bundle], [False])
    pos, n_acc = 20, bundle
    for acc in accepted:
        sl = slice(pos, pos + bundle)  # tokens past the accepted ones are the rejected drafts
        gated_delta_rule_verify(q[None, sl], k[None, sl], v[None, sl], a[None, sl], b[None, sl],
                                A_log, dt_bias, pool, slots, torch.tensor([n_acc]))
        pos, n_acc = pos + acc, acc
    ref_pool = torch.zeros_like(pool)
    _prefill(q[:pos], k[:pos], v[:pos], a[:pos], b[:pos], A_log, dt_bias, ref_pool, [pos], [0],
             [1], [False])
    torch.testing.assert_close(pool[slots[0, n_acc - 1]], ref_pool[1], **TOL[dt])


def test_debug_mode_checks_shapes():
    q, k, v, a, b, A_log, dt_bias = raw_inputs(6, 2, 4, seed=6)
    pool = torch.zeros(4, 4, 8, 6)
    args = (q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([0, 2, 6]), torch.tensor([1, 2]),
            torch.tensor([1, 2]), torch.tensor([False, True]))
    qv, kv, vv, av, bv, _, _ = raw_inputs(2, 2, 4, seed=7, lead=(2,))
    vargs = (qv, kv, vv, av, bv, A_log, dt_bias, pool, torch.tensor([[1, 2], [0, 0]]), torch.tensor([2, 1]))
    with shapes.debug() as trace:
        gated_delta_rule_prefill(*args)
        gated_delta_rule_verify(*vargs)
        core = core_inputs(5, H=4)
        gdn_recurrent_core(*core)
        gdn_chunked_core(*core, chunk_size=4)
        assert {"kernels.gdn.gated_delta_rule_prefill", "kernels.gdn.gated_delta_rule_verify",
                "kernels.gdn.gdn_prepare", "kernels.gdn.gdn_chunked_core"} <= set(trace.functions())
        with pytest.raises(shapes.ShapeError):  # query_start_loc must be num_reqs + 1 long
            gated_delta_rule_prefill(*args[:8], torch.tensor([0, 6]), *args[9:])
        with pytest.raises(shapes.ShapeError):  # bundle of state_slots disagrees with q
            gated_delta_rule_verify(*vargs[:8], torch.tensor([[1, 2, 3], [0, 0, 0]]), vargs[9])
        with pytest.raises(shapes.ShapeError):  # state pool with the wrong v_heads
            gated_delta_rule_prefill(*args[:7], torch.zeros(4, 2, 8, 6), *args[8:])
        with pytest.raises(shapes.ShapeError):
            gdn_recurrent_core(*core[:5], torch.zeros(4, 8, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [16, 96])
def test_prefill_rows_equal_the_varlen_prefill(dtype, T):
    """gated_delta_rule_prefill_rows (a captured prefill: chunks padded at their ends to one
    length, the padding given decay 0 and beta 0) gives the varlen prefill's outputs at the real
    tokens, the same final states and the same state snapshots (any position, inside a chunk or
    at its end); padding of any value leaves the state untouched."""
    from mtpkit.kernels.gdn import gated_delta_rule_prefill_rows
    from mtpkit.step.metadata import StateSnapshots

    hk, hv = 2, 4
    lens = [T - 3, 1, T]
    slots, init = [1, 2, 4], [True, False, True]
    q, k, v, a, b, A_log, dt_bias = raw_inputs(T * 3, hk, hv, dtype=dtype, seed=6)
    pool = torch.randn(6, hv, 8, 6, dtype=dtype)
    pool[2] = float("nan")                             # no initial state: never read
    ref_pool = pool.clone()
    rows = [slice(i * T, i * T + n) for i, n in enumerate(lens)]
    wanted = [(0, 5, 3), (0, T - 4, 0), (1, 0, 2), (2, T - 1, 5), (2, 15, 1)]   # (row, position, snapshot id)
    qsl = [0, lens[0], lens[0] + lens[1]]

    def snaps(start):
        return StateSnapshots(rows=torch.tensor([r for r, _, _ in wanted]),
                              token_index=torch.tensor([start[r] + p for r, p, _ in wanted]),
                              ids=torch.tensor([i for _, _, i in wanted]))
    store = torch.zeros(6, hv, 8, 6, dtype=dtype)
    ref_store = store.clone()
    ref = gated_delta_rule_prefill(*(torch.cat([t[r] for r in rows]) for t in (q, k, v, a, b)), A_log, dt_bias,
                                   ref_pool, torch.tensor(qsl + [sum(lens)]), torch.tensor(slots), torch.tensor(slots),
                                   torch.tensor(init), chunk_size=64, snapshots=snaps(qsl), snapshot_state=ref_store)
    got_pool = pool.clone()
    out = gated_delta_rule_prefill_rows(q, k, v, a, b, A_log, dt_bias, got_pool, torch.tensor(slots),
                                        torch.tensor(init), torch.tensor(lens), snapshots=snaps([0, T, 2 * T]),
                                        snapshot_state=store)
    torch.testing.assert_close(torch.cat([out[r] for r in rows]), ref, **TOL[dtype])
    torch.testing.assert_close(got_pool, ref_pool, **TOL[dtype], equal_nan=True)
    torch.testing.assert_close(store, ref_store, **TOL[dtype])
    assert torch.isfinite(out).all() and store[4].abs().sum() == 0


def test_traced_entry_points_keep_float64():
    """Under torch.jit.trace a shape is a traced int tensor: q's k_dim**-0.5 scale once became a
    float32 value inside every traced GDN graph (1e-8 relative error in float64). The traced verify
    and the traced prefill rows equal their direct calls to float64 rounding."""
    import warnings

    from mtpkit.kernels.gdn import gated_delta_rule_prefill_rows

    d = torch.float64
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=d)  # noqa: E731
    R, B, HK, HV, DK, DV = 2, 4, 2, 4, 32, 16
    verify = (r(R, B, HK, DK), r(R, B, HK, DK), r(R, B, HV, DV), r(R, B, HV), r(R, B, HV), r(HV).abs(), r(HV),
              r(9, HV, DK, DV), torch.arange(1, 9).view(R, B), torch.tensor([1, 2]))
    q, k, v, a, b, A_log, dt_bias = raw_inputs(32, HK, HV, dk=DK, dv=DV, dtype=d, seed=7)
    rows = (q, k, v, a, b, A_log, dt_bias, r(3, HV, DK, DV), torch.tensor([1, 2]), torch.tensor([True, False]),
            torch.tensor([11, 16]))
    for fn, args in ((gated_delta_rule_verify, verify), (gated_delta_rule_prefill_rows, rows)):
        def call(*x, fn=fn):
            return fn(*x)
        ref = call(*(x.clone() for x in args))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(call, tuple(x.clone() for x in args), check_trace=False)
        for _ in range(3):   # the profiling executor optimises on its first runs
            out = traced(*(x.clone() for x in args))
        torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-13)
