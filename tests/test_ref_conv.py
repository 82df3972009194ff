"""The pure-torch causal conv1d + SiLU references against a direct conv over each request's
true input history, and the speculative conv-state contract (window at offset a-1)."""

import pytest
import torch
import torch.nn.functional as F

from mtpkit import shapes
from mtpkit.kernels.conv import causal_conv1d_prefill, causal_conv1d_verify

C, W = 10, 4
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float64: dict(atol=1e-14, rtol=1e-14),
       torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def direct(history, weight):
    """silu(depthwise causal conv) of a whole [T, C] history, zero left padding, fp64."""
    x = history.double().T[None]
    y = F.conv1d(F.pad(x, (weight.shape[1] - 1, 0)), weight.double()[:, None, :], groups=x.shape[1])
    return F.silu(y)[0].T


def data(T, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, C, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(C, W, generator=gen, dtype=torch.float64).to(dtype))


def prefill(x, weight, state, lens, slots, has_init):
    qsl = torch.tensor([0] + lens).cumsum(0)
    return causal_conv1d_prefill(x, weight, state, qsl, torch.tensor(slots), torch.tensor(has_init))


def pool_dtype(dtype):
    return torch.float32 if dtype == torch.bfloat16 else dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("num_spec", [0, 2])
def test_prefill_varlen_equals_direct_conv(dtype, num_spec):
    lens = [19, 2, 5]  # a request shorter than the window too; one long enough for the taps form
    x, w = data(sum(lens), dtype)
    state = torch.randn(5, C, W - 1 + num_spec, dtype=pool_dtype(dtype))
    before = state.clone()
    out = prefill(x, w, state, lens, [3, 1, 4], [False, False, False])
    assert out.dtype == dtype
    bounds = [0, 19, 21, 26]
    for i, slot in enumerate([3, 1, 4]):
        xi = x[bounds[i]:bounds[i + 1]]
        torch.testing.assert_close(out[bounds[i]:bounds[i + 1]].double(), direct(xi, w), **TOL[dtype])
        # The state keeps the last W-1+num_spec inputs (zeros before the first one).
        hist = torch.cat([torch.zeros(W - 1 + num_spec, C, dtype=dtype), xi])
        torch.testing.assert_close(state[slot], hist[-(W - 1 + num_spec):].T.to(state.dtype), atol=0, rtol=0)
    torch.testing.assert_close(state[[0, 2]], before[[0, 2]], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_spec", [0, 3])
def test_prefill_in_chunks_equals_one_shot(dtype, num_spec):
    x, w = data(20, dtype, seed=1)
    state = torch.zeros(3, C, W - 1 + num_spec, dtype=dtype)
    one = prefill(x, w, state, [20], [1], [False])
    state2 = torch.full_like(state, float("nan"))  # has_initial_state False must not read it
    cuts = [0, 1, 2, 9, 10, 20]
    outs = [prefill(x[s:e], w, state2, [e - s], [2], [j > 0]) for j, (s, e) in enumerate(zip(cuts, cuts[1:]))]
    torch.testing.assert_close(torch.cat(outs), one, **TOL[dtype])
    torch.testing.assert_close(state2[2], state[1], atol=0, rtol=0)


def test_prefill_reads_window_after_other_requests_write():
    # Two requests in one call; each slot is read and written; results equal each alone.
    x, w = data(12, seed=2)
    state = torch.randn(3, C, W - 1 + 1)
    alone = state.clone()
    out = prefill(x, w, state, [7, 5], [1, 2], [True, True])
    o1 = prefill(x[:7], w, alone, [7], [1], [True])
    o2 = prefill(x[7:], w, alone, [5], [2], [True])
    torch.testing.assert_close(out, torch.cat([o1, o2]), **TOL[torch.float32])
    torch.testing.assert_close(state, alone, atol=0, rtol=0)


def _history_setup(R, num_spec, dtype, seed=0, hist_len=6):
    """R requests, each prefilled with hist_len inputs into slot i + 1; slot 0 is null."""
    x, w = data(R * hist_len, dtype, seed)
    state = torch.zeros(R + 1, C, W - 1 + num_spec, dtype=pool_dtype(dtype))
    prefill(x, w, state, [hist_len] * R, list(range(1, R + 1)), [False] * R)
    return [x[i * hist_len:(i + 1) * hist_len] for i in range(R)], w, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bundle", [1, 2, 3, 4])
def test_verify_every_prev_num_emitted_equals_true_history(bundle, dtype):
    """Step 1 (after prefill, prev_num_emitted = bundle) with drafts; request i accepts i+1 of
    them; step 2 reads its window at offset a-1 and must equal conv over the true history;
    a padded row (slot 0, prev_num_emitted 1) rides along."""
    num_spec = bundle - 1
    hists, w, state = _history_setup(bundle, num_spec, dtype)
    gen = torch.Generator().manual_seed(11)
    steps = [torch.randn(bundle + 1, bundle, C, generator=gen, dtype=torch.float64).to(dtype)
             for _ in range(2)]
    slots = torch.tensor(list(range(1, bundle + 1)) + [0])
    accepted = list(range(1, bundle + 1))
    out1 = causal_conv1d_verify(steps[0], w, state, slots, torch.tensor([bundle] * bundle + [1]))
    out2 = causal_conv1d_verify(steps[1], w, state, slots, torch.tensor(accepted + [1]))
    assert out2.dtype == dtype
    for i, a in enumerate(accepted):
        ref1 = direct(torch.cat([hists[i], steps[0][i]]), w)[-bundle:]
        torch.testing.assert_close(out1[i].double(), ref1, **TOL[dtype])
        true = torch.cat([hists[i], steps[0][i, :a], steps[1][i]])
        torch.testing.assert_close(out2[i].double(), direct(true, w)[-bundle:], **TOL[dtype])
    assert torch.isfinite(out1[bundle]).all() and torch.isfinite(out2[bundle]).all()


@pytest.mark.parametrize("accepted", [[1, 1, 1], [3, 1, 2], [2, 3, 3], [1, 3, 1]])
def test_state_after_verifies_equals_non_speculative_history(accepted):
    bundle, dt = 3, torch.float64
    hists, w, state = _history_setup(1, bundle - 1, dt, seed=3)
    gen = torch.Generator().manual_seed(4)
    history, n_acc = hists[0], bundle
    for a in accepted:
        step = torch.randn(1, bundle, C, generator=gen, dtype=dt)
        causal_conv1d_verify(step, w, state, torch.tensor([1]), torch.tensor([n_acc]))
        history, n_acc = torch.cat([history, step[0, :a]]), a
    # The window the next step reads (offset a-1) is the last W-1 accepted inputs.
    torch.testing.assert_close(state[1, :, n_acc - 1:n_acc - 1 + W - 1], history[-(W - 1):].T, atol=0, rtol=0)
    nxt = torch.randn(1, bundle, C, generator=gen, dtype=dt)
    out = causal_conv1d_verify(nxt, w, state, torch.tensor([1]), torch.tensor([n_acc]))
    torch.testing.assert_close(out[0], direct(torch.cat([history, nxt[0]]), w)[-bundle:], **TOL[dt])


def test_zero_draft_steps_stay_on_the_spec_path():
    """A step that feeds fewer tokens than num_spec + 1 (e.g. no drafts this step) keeps the
    offset a-1 contract: the state is aligned to the window's start, not right-aligned."""
    num_spec, dt = 3, torch.float64
    hists, w, state = _history_setup(1, num_spec, dt, seed=5)
    gen = torch.Generator().manual_seed(6)
    history, n_acc = hists[0], num_spec + 1
    for bundle, a in [(1, 1), (1, 1), (4, 2), (2, 2), (1, 1), (4, 4)]:
        step = torch.randn(1, bundle, C, generator=gen, dtype=dt)
        out = causal_conv1d_verify(step, w, state, torch.tensor([1]), torch.tensor([n_acc]))
        torch.testing.assert_close(out[0], direct(torch.cat([history, step[0]]), w)[-bundle:], **TOL[dt])
        history, n_acc = torch.cat([history, step[0, :a]]), a


def test_padded_rows_only_touch_null_slot():
    hists, w, state = _history_setup(2, 2, torch.float32, seed=7)
    state = torch.cat([state, torch.randn(2, C, W - 1 + 2)])  # spare slots 3, 4
    before = state.clone()
    x = torch.randn(4, 3, C)
    out = causal_conv1d_verify(x, w, state, torch.tensor([2, 0, 1, 0]), torch.tensor([3, 1, 2, 1]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(state[3:], before[3:], atol=0, rtol=0)
    assert not torch.equal(state[1], before[1]) and not torch.equal(state[2], before[2])


def test_verify_rejects_too_short_state():
    _, w = data(1)
    with pytest.raises(ValueError, match="conv_state_len"):
        causal_conv1d_verify(torch.randn(1, 3, C), w, torch.zeros(2, C, W - 1 + 1),
                             torch.tensor([1]), torch.tensor([1]))


def test_debug_mode_checks_shapes():
    x, w = data(6)
    state = torch.zeros(3, C, W - 1 + 2)
    pargs = (x, w, state, torch.tensor([0, 2, 6]), torch.tensor([1, 2]), torch.tensor([True, False]))
    vargs = (torch.randn(2, 3, C), w, state, torch.tensor([1, 0]), torch.tensor([3, 1]))
    with shapes.debug() as trace:
        causal_conv1d_prefill(*pargs)
        causal_conv1d_verify(*vargs)
        assert trace.functions() == ["kernels.conv.causal_conv1d_prefill", "kernels.conv.causal_conv1d_verify"]
        assert trace.entries[1].dims["conv_state_len"] == W - 1 + 2
        with pytest.raises(shapes.ShapeError):  # slots must have num_reqs entries
            causal_conv1d_prefill(*pargs[:4], torch.tensor([1]), pargs[5])
        with pytest.raises(shapes.ShapeError):  # weight conv_dim disagrees with x
            causal_conv1d_verify(vargs[0], torch.zeros(C + 1, W), *vargs[2:])
        with pytest.raises(shapes.ShapeError):  # prev_num_emitted must be integers
            causal_conv1d_verify(*vargs[:4], torch.tensor([3.0, 1.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_spec", [0, 2])
def test_prefill_rows_equal_the_varlen_prefill(dtype, num_spec):
    """causal_conv1d_prefill_rows (a captured prefill: chunks padded at their ends to one length)
    gives the varlen prefill's outputs at the real tokens, leaves the same slots whatever the
    padding holds, and writes the same state snapshots; a row with initial state reads its
    window, one without never does."""
    from mtpkit.kernels.conv import causal_conv1d_prefill_rows
    from mtpkit.step.metadata import StateSnapshots

    T, lens, slots, init = 32, [19, 3, 32], [3, 1, 4], [True, False, True]
    x, w = data(T * 3, dtype, seed=5)
    state = torch.randn(5, C, W - 1 + num_spec, dtype=dtype)
    state[1] = float("nan")                            # no initial state: never read
    ref_state = state.clone()
    wanted = [(0, 1, 2), (0, 18, 0), (1, 2, 3), (2, 30, 1)]   # (row, position in its chunk, snapshot id)

    def snaps(start):
        return StateSnapshots(rows=torch.tensor([r for r, _, _ in wanted]),
                              token_index=torch.tensor([start[r] + p for r, p, _ in wanted]),
                              ids=torch.tensor([i for _, _, i in wanted]))
    store = torch.zeros(4, C, W - 1 + num_spec, dtype=dtype)
    ref_store = store.clone()
    real = torch.cat([x[i * T:i * T + n] for i, n in enumerate(lens)])
    ref = causal_conv1d_prefill(real, w, ref_state, torch.tensor([0, 19, 22, 54]), torch.tensor(slots),
                                torch.tensor(init), snapshots=snaps([0, 19, 22]), snapshot_state=ref_store)
    got_state = state.clone()
    out = causal_conv1d_prefill_rows(x, w, got_state, torch.tensor(slots), torch.tensor(init), torch.tensor(lens),
                                     snapshots=snaps([0, T, 2 * T]), snapshot_state=store)
    got = torch.cat([out[i * T:i * T + n] for i, n in enumerate(lens)])
    torch.testing.assert_close(got, ref, **TOL[dtype])
    torch.testing.assert_close(got_state, ref_state, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(store, ref_store, atol=0, rtol=0)
    assert torch.isfinite(out).all()
