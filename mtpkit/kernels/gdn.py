"""Pure-torch reference of the gated delta rule (Gated DeltaNet): the "torch" backend's
Ops.gated_delta_rule_prefill / gated_delta_rule_verify, and the oracle that the Triton kernels
in triton_gdn.py (same names and signatures) are tested against. Clarity and exactness come
before speed.

Per value head the state S is [k_dim, v_dim]; per token t (g_t <= 0 is a log-decay):
    S = exp(g_t) * S;   S = S + k_t (beta_t * (v_t - k_t^T S))^T;   o_t = q_t^T S.

Math runs in fp32, or in fp64 when the inputs are fp64, so that fp64 engine tests can ask
for 1e-12 agreement; outputs are cast back to v's dtype, states to the pool's dtype.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange

from mtpkit.shapes import Bool, Float, Int, Tensor, checked
from mtpkit.step.metadata import StateSnapshots

__all__ = [
    "gdn_recurrent_core", "gdn_chunked_core", "gdn_prepare",
    "gated_delta_rule_prefill", "gated_delta_rule_prefill_rows", "gated_delta_rule_verify",
]


def _compute_dtype(*xs: Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


@checked
def gdn_recurrent_core(
    q: Float[Tensor, "seq_len v_heads k_dim"],
    k: Float[Tensor, "seq_len v_heads k_dim"],
    v: Float[Tensor, "seq_len v_heads v_dim"],
    g: Float[Tensor, "seq_len v_heads"],
    beta: Float[Tensor, "seq_len v_heads"],
    initial_state: Float[Tensor, "v_heads k_dim v_dim"],
) -> tuple[Float[Tensor, "seq_len v_heads v_dim"], Float[Tensor, "v_heads k_dim v_dim"]]:
    """Token-by-token gated delta rule on prepared inputs (q already normalised and scaled,
    heads already repeated to v_heads). Returns (o, final_state) in the compute dtype."""
    cd = _compute_dtype(q, k, v, initial_state)
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))
    state = initial_state.to(cd).clone()
    o = q.new_empty(v.shape)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        # What the decayed state already predicts for k_t; only the error is written.
        predicted = torch.einsum("hk,hkv->hv", k[t], state)
        delta = beta[t][:, None] * (v[t] - predicted)
        state = state + k[t][:, :, None] * delta[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return o, state


@checked
def gdn_chunked_core(
    q: Float[Tensor, "seq_len v_heads k_dim"],
    k: Float[Tensor, "seq_len v_heads k_dim"],
    v: Float[Tensor, "seq_len v_heads v_dim"],
    g: Float[Tensor, "seq_len v_heads"],
    beta: Float[Tensor, "seq_len v_heads"],
    initial_state: Float[Tensor, "v_heads k_dim v_dim"],
    chunk_size: int = 64,
    snap_at: Sequence[int] = (),
    snaps: list | None = None,
    snap_index: Int[Tensor, "num_snapshots v_heads"] | None = None,
) -> tuple[Float[Tensor, "seq_len v_heads v_dim"], Float[Tensor, "v_heads k_dim v_dim"]]:
    """The same recurrence, chunk by chunk (UT-transform / WY form), exact up to rounding.

    Inside a chunk, with G_t = g_0 + ... + g_t (cumulative log-decay from the chunk start)
    and S0 the state entering the chunk, unrolling the recurrence gives
        u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{j<t} exp(G_t - G_j) (k_t.k_j) u_j)
        o_t = exp(G_t) S0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t.k_j) u_j
        S   = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T
    where u_t is the delta actually written for token t. The first line is a unit lower
    triangular system (I + A) U = beta V - beta exp(G) K S0, solved once per chunk.
    The last chunk may be shorter: it is sliced rather than zero-padded, so no padding
    token ever touches the state.

    snap_at (ascending token indices): the state after each of them is appended to `snaps`
    (compute dtype), by the last line truncated at t: S_t = exp(G_t) S0 + sum_{j<=t}
    exp(G_t - G_j) k_j u_j^T (u_j for j <= t does not depend on later tokens), so a state
    inside a chunk is exact like the one at its end (the same expression there).
    snap_index (a tensor, so a trace or compiled graph holds it for any values): the state of
    every head after token snap_index[s, h], the same expression computed in every chunk and kept
    where the token falls in it; appended to `snaps` as one [num_snapshots, heads, dk, dv] tensor.
    """
    cd = _compute_dtype(q, k, v, initial_state)
    # Head-major: every per-chunk product below is a batched matmul over heads.
    q, k, v = (x.to(cd).transpose(0, 1) for x in (q, k, v))  # [H, T, d]
    g, beta = (x.to(cd).transpose(0, 1) for x in (g, beta))  # [H, T]
    state = initial_state.to(cd).clone()
    seq_len = q.shape[1]
    o = q.new_empty(q.shape[0], seq_len, v.shape[-1])
    at = None if snap_index is None else state.new_zeros((snap_index.shape[0],) + tuple(state.shape))
    for start in range(0, seq_len, chunk_size):
        sl = slice(start, min(start + chunk_size, seq_len))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        G = g[:, sl].cumsum(-1)  # [H, c]
        c = G.shape[-1]
        # exp(G_t - G_j) for j <= t; the upper triangle is set to -inf before exp so that
        # large positive differences never overflow.
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        kk = kc @ kc.transpose(-1, -2)  # [H, c, c]
        A = (bc[:, :, None] * kk * decay).tril(-1)
        eG = G.exp()[:, :, None]
        rhs_v = bc[:, :, None] * vc
        rhs_s = bc[:, :, None] * eG * kc  # multiplies S0 from the right
        rhs = torch.cat([rhs_v, rhs_s], dim=-1)
        # (I + A) U = rhs; unitriangular: the solver takes the unit diagonal as given and reads
        # only A's strictly lower triangle, so I + A need not be formed.
        sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        w_v, w_s = sol.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        u = w_v - w_s @ state  # [H, c, dv]
        qk = (qc @ kc.transpose(-1, -2)) * decay  # includes the diagonal (j == t)
        o[:, sl] = (eG * qc) @ state + qk @ u
        for t in (p - start for p in snap_at if start <= p < sl.stop):
            inner = (G[:, t:t + 1] - G[:, :t + 1]).exp()  # exp(G_t - G_j), j <= t
            snaps.append(G[:, t].exp()[:, None, None] * state
                         + (inner[:, :, None] * kc[:, :t + 1]).transpose(-1, -2) @ u[:, :t + 1])
        if at is not None:
            t = (snap_index - start).clamp(0, c - 1)[..., None]                          # [S, H, 1]
            Gt = G.expand(t.shape[0], -1, -1).gather(-1, t)                              # G_t, [S, H, 1]
            later = torch.arange(c, device=q.device) > t                                  # j > t: not yet
            inner = (Gt - G).masked_fill(later, float("-inf")).exp()                     # [S, H, c]
            s_t = Gt[..., None].exp() * state + torch.einsum("shc,hck,hcv->shkv", inner, kc, u)
            inside = (snap_index >= start) & (snap_index < sl.stop)
            at = torch.where(inside[..., None, None], s_t, at)
        tail = (G[:, -1:] - G).exp()  # exp(G_last - G_j)
        state = G[:, -1].exp()[:, None, None] * state + (tail[:, :, None] * kc).transpose(-1, -2) @ u
    if at is not None:
        snaps.append(at)
    return o.transpose(0, 1), state


@checked
def gdn_prepare(
    q: Float[Tensor, "num_tokens k_heads k_dim"],
    k: Float[Tensor, "num_tokens k_heads k_dim"],
    a: Float[Tensor, "num_tokens v_heads"],
    b: Float[Tensor, "num_tokens v_heads"],
    A_log: Float[Tensor, "v_heads"],
    dt_bias: Float[Tensor, "v_heads"],
    dtype: torch.dtype = torch.float32,
) -> tuple[
    Float[Tensor, "num_tokens v_heads k_dim"], Float[Tensor, "num_tokens v_heads k_dim"],
    Float[Tensor, "num_tokens v_heads"], Float[Tensor, "num_tokens v_heads"],
]:
    """The preprocessing shared by prefill and verify: returns (q, k, g, beta) in `dtype`
    (fp32, or fp64 for fp64 models): q and k L2-normalised per head (eps inside the rsqrt,
    as transformers / FLA do), q scaled by k_dim**-0.5, heads repeated k_heads -> v_heads,
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)."""
    k_heads, v_heads = q.shape[1], a.shape[1]
    if v_heads % k_heads:
        raise ValueError(f"v_heads ({v_heads}) must be a multiple of k_heads ({k_heads})")
    q, k = q.to(dtype), k.to(dtype)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    # The scale as a tensor of the compute dtype: under torch.jit.trace q.shape[-1] is a traced int
    # tensor, and `** -0.5` of it would be computed in float32 (1e-8 relative error in an fp64 graph).
    q = q * torch.full((), q.shape[-1], dtype=dtype, device=q.device).rsqrt()
    # Value head h reads key head h // r (the checkpoint groups value heads per key head).
    r = v_heads // k_heads
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    beta = torch.sigmoid(b.to(dtype))
    g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
    return q, k, g, beta


@checked
def gated_delta_rule_prefill(
    q: Float[Tensor, "num_tokens k_heads k_dim"],
    k: Float[Tensor, "num_tokens k_heads k_dim"],
    v: Float[Tensor, "num_tokens v_heads v_dim"],
    a: Float[Tensor, "num_tokens v_heads"],
    b: Float[Tensor, "num_tokens v_heads"],
    A_log: Float[Tensor, "v_heads"],
    dt_bias: Float[Tensor, "v_heads"],
    ssm_state: Float[Tensor, "num_slots v_heads k_dim v_dim"],
    query_start_loc: Int[Tensor, "num_reqs+1"],
    read_slots: Int[Tensor, "num_reqs"],
    write_slots: Int[Tensor, "num_reqs"],
    has_initial_state: Bool[Tensor, "num_reqs"],
    chunk_size: int = 64,
    snapshots: StateSnapshots | None = None,
    snapshot_state: Float[Tensor, "snapshot_slots v_heads k_dim v_dim"] | None = None,
) -> Float[Tensor, "num_tokens v_heads v_dim"]:
    """Varlen prefill over packed requests: request i owns tokens [qsl[i], qsl[i+1]),
    starts from ssm_state[read_slots[i]] (zeros when not has_initial_state[i]) and leaves
    its final state in ssm_state[write_slots[i]] (in place, in the pool's dtype).
    `snapshots`: the state after each snapshot's token goes to snapshot_state[its id] too.
    Returns the core output (before the gated norm) in v's dtype."""
    cd = _compute_dtype(q, k, v)
    qp, kp, g, beta = gdn_prepare(q, k, a, b, A_log, dt_bias, dtype=cd)
    vc = v.to(cd)
    # Every initial state is read before any is written, so a request's write slot may be
    # another request's read slot without the order of the loop mattering.
    has_init = has_initial_state.to(ssm_state.device)
    # A request without initial state may carry any read slot: it is never dereferenced.
    init = ssm_state[torch.where(has_init, read_slots.long(), 0)].to(cd)
    init = torch.where(has_init[:, None, None, None], init, 0)
    bounds = query_start_loc.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    R, T = len(lens), max(lens, default=0)
    # Snapshots per request: (position in its chunk, snapshot id), ascending.
    wanted: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    if snapshots is not None:
        for row, tok, sid in zip(*(x.tolist() for x in (snapshots.rows, snapshots.token_index, snapshots.ids))):
            wanted[row].append((tok - bounds[row], sid))
        for w in wanted:
            w.sort()
    snap_ids, snap_states = [], []
    if R > 1 and R * T <= 2 * sum(lens):
        out, finals = _prefill_padded(qp, kp, vc, g, beta, init, bounds, T, chunk_size, wanted, snap_ids,
                                      snap_states)
    else:  # one request, or lengths too uneven for padding to pay
        out, finals = vc.new_empty(vc.shape), []
        for i in range(R):
            sl = slice(bounds[i], bounds[i + 1])
            out[sl], s_i = gdn_chunked_core(qp[sl], kp[sl], vc[sl], g[sl], beta[sl], init[i],
                                            chunk_size=chunk_size, snap_at=[p for p, _ in wanted[i]],
                                            snaps=snap_states)
            snap_ids += [sid for _, sid in wanted[i]]
            finals.append(s_i)
        finals = torch.stack(finals) if finals else None
    if snap_ids:
        snapshot_state[torch.tensor(snap_ids, device=snapshot_state.device)] = \
            torch.stack(snap_states).to(snapshot_state.dtype)
    if finals is not None:
        ssm_state[write_slots.long()] = finals.to(ssm_state.dtype)
    return out.to(v.dtype)


@checked
def gated_delta_rule_prefill_rows(
    q: Float[Tensor, "num_tokens k_heads k_dim"],
    k: Float[Tensor, "num_tokens k_heads k_dim"],
    v: Float[Tensor, "num_tokens v_heads v_dim"],
    a: Float[Tensor, "num_tokens v_heads"],
    b: Float[Tensor, "num_tokens v_heads"],
    A_log: Float[Tensor, "v_heads"],
    dt_bias: Float[Tensor, "v_heads"],
    ssm_state: Float[Tensor, "num_slots v_heads k_dim v_dim"],
    slots: Int[Tensor, "num_reqs_padded"],
    has_initial_state: Bool[Tensor, "num_reqs_padded"],
    num_real: Int[Tensor, "num_reqs_padded"],
    chunk_size: int = 64,
    snapshots: StateSnapshots | None = None,
    snapshot_state: Float[Tensor, "snapshot_slots v_heads k_dim v_dim"] | None = None,
) -> Float[Tensor, "num_tokens v_heads v_dim"]:
    """A prefill over rows of equal length (a captured prefill: step.metadata.PrefillRows): row i
    owns tokens [i*q_len, (i+1)*q_len), of which the first num_real[i] are its chunk and the rest
    padding; it starts from ssm_state[slots[i]] (zeros when not has_initial_state[i]) and leaves
    the state after its last real token there. The padding gets g = 0 (no decay) and beta = 0 (no
    write), which leaves the state exactly as the last real token left it (as `_prefill_padded`
    pads rows): no host read, so a trace or a compiled graph holds it for any num_real.
    `snapshots` (token_index into these padded rows): the state after each snapshot's token goes to
    snapshot_state[its id] too, also without a host read. Returns the core output in v's dtype
    (padding positions: finite values nothing reads)."""
    R = slots.shape[0]
    T = q.shape[0] // R
    cd = _compute_dtype(q, k, v)
    qp, kp, g, beta = gdn_prepare(q, k, a, b, A_log, dt_bias, dtype=cd)
    real = (torch.arange(T, device=q.device)[None, :] < num_real[:, None]).reshape(-1, 1).to(cd)   # [R*T, 1]
    g, beta = g * real, beta * real
    has_init = has_initial_state.to(ssm_state.device)
    init = ssm_state[torch.where(has_init, slots, 0)].to(cd)
    init = torch.where(has_init[:, None, None, None], init, 0)

    def fold(x):  # [R*T, heads, ...] -> [T, R*heads, ...]: the recurrence is independent per head
        return rearrange(x.view((R, T) + tuple(x.shape[1:])), "r t h ... -> t (r h) ...")
    snaps, snap_index, h = [], None, v.shape[1]
    if snapshots is not None:   # each snapshot's position in its row, for every folded head
        snap_index = (snapshots.token_index - snapshots.rows * T)[:, None].expand(-1, R * h)
    o, state = gdn_chunked_core(fold(qp), fold(kp), fold(v.to(cd)), fold(g), fold(beta),
                                rearrange(init, "r h dk dv -> (r h) dk dv"), chunk_size=chunk_size,
                                snaps=snaps, snap_index=snap_index)
    if snapshots is not None:   # the heads of each snapshot's own row
        at = snaps[0].view(-1, R, h, *snaps[0].shape[2:])[torch.arange(snap_index.shape[0], device=q.device),
                                                          snapshots.rows]
        snapshot_state.index_copy_(0, snapshots.ids, at.to(snapshot_state.dtype))
    ssm_state[slots] = rearrange(state, "(r h) dk dv -> r h dk dv", r=R).to(ssm_state.dtype)
    return rearrange(o, "t (r h) dv -> (r t) h dv", r=R).to(v.dtype)


def _prefill_padded(q, k, v, g, beta, init, bounds, T, chunk_size, wanted, snap_ids, snap_states):
    """All requests in one chunked pass: pad each to T tokens at the END with g = 0 (no
    decay) and beta = 0 (no write), which leaves the state exactly unchanged, and fold the
    request dim into the head dim (the recurrence is independent per head). A snapshot's
    state is computed for every request's heads at its position and its request's kept."""
    R = len(bounds) - 1

    def pad(x):  # [num_tokens, heads, ...] -> [T, R*heads, ...]
        out = x.new_zeros((R, T) + tuple(x.shape[1:]))
        for i in range(R):
            out[i, : bounds[i + 1] - bounds[i]] = x[bounds[i]:bounds[i + 1]]
        return rearrange(out, "r t h ... -> t (r h) ...")

    at = sorted({p for w in wanted for p, _ in w})
    states: list = []
    o, state = gdn_chunked_core(pad(q), pad(k), pad(v), pad(g), pad(beta),
                                rearrange(init, "r h dk dv -> (r h) dk dv"), chunk_size=chunk_size,
                                snap_at=at, snaps=states)
    for i, w in enumerate(wanted):
        for p, sid in w:
            snap_ids.append(sid)
            snap_states.append(rearrange(states[at.index(p)], "(r h) dk dv -> r h dk dv", r=R)[i])
    o = rearrange(o, "t (r h) dv -> r t h dv", r=R)
    out = torch.cat([o[i, : bounds[i + 1] - bounds[i]] for i in range(R)])
    return out, rearrange(state, "(r h) dk dv -> r h dk dv", r=R)


# x stays plain Tensor: a dtype helper for q, k, v, gates and parameters alike (no one shape name fits).
def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in `dtype`, without a dispatch when it already is (any shape: a dtype helper)."""
    return x if x.dtype == dtype else x.to(dtype)


def _l2norm(x: Float[Tensor, "... d"], dtype: torch.dtype) -> Float[Tensor, "... d"]:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim (eps inside, as transformers / FLA do)."""
    x = _as(x, dtype)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@checked
def gated_delta_rule_verify(
    q: Float[Tensor, "num_reqs_padded bundle k_heads k_dim"],
    k: Float[Tensor, "num_reqs_padded bundle k_heads k_dim"],
    v: Float[Tensor, "num_reqs_padded bundle v_heads v_dim"],
    a: Float[Tensor, "num_reqs_padded bundle v_heads"],
    b: Float[Tensor, "num_reqs_padded bundle v_heads"],
    A_log: Float[Tensor, "v_heads"],
    dt_bias: Float[Tensor, "v_heads"],
    ssm_state: Float[Tensor, "num_slots v_heads k_dim v_dim"],
    state_slots: Int[Tensor, "num_reqs_padded bundle"],
    prev_num_emitted: Int[Tensor, "num_reqs_padded"],
) -> Float[Tensor, "num_reqs_padded bundle v_heads v_dim"]:
    """A uniform verify/decode step (vLLM's contract: docs/design.md, "Contracts"): request i starts
    from ssm_state[state_slots[i, prev_num_emitted[i] - 1]] and the state after its token t
    is written to ssm_state[state_slots[i, t]]. Padded rows point every slot at the null
    slot 0 with prev_num_emitted 1: they read and write only slot 0 (finite as long as the
    pool was zero-initialised, since only finite states are ever written there).

    The same preparation as gdn_prepare, batched over requests, with the value heads grouped
    under their key head ([k_heads, r] = v_heads; value head h reads key head h // r) so
    that broadcasting, not a copy, repeats q and k."""
    R, B, HK, DK = q.shape
    HV, DV = v.shape[2:]
    if HV % HK:
        raise ValueError(f"v_heads ({HV}) must be a multiple of k_heads ({HK})")
    r, cd = HV // HK, _compute_dtype(q, k, v)
    q = _l2norm(q, cd) * torch.full((), DK, dtype=cd, device=q.device).rsqrt()   # (as gdn_prepare: traced)
    k = _l2norm(k, cd)
    g = -_as(A_log, cd).exp() * F.softplus(_as(a, cd) + _as(dt_bias, cd))     # [R, B, HV]
    # Per token t (dim 1), shaped to broadcast against the state [R, HK, r, DK, DV]:
    decay = g.exp().view(R, B, HK, r, 1, 1).unbind(1)
    beta = torch.sigmoid(_as(b, cd)).view(R, B, HK, r, 1, 1).unbind(1)
    vs = _as(v, cd).view(R, B, HK, r, 1, DV).unbind(1)
    k_row, k_col = k.view(R, B, HK, 1, 1, DK).unbind(1), k.view(R, B, HK, 1, DK, 1).unbind(1)
    q_row = q.view(R, B, HK, 1, 1, DK).unbind(1) if B == 1 else None
    read = state_slots.gather(1, prev_num_emitted[:, None] - 1)[:, 0]
    # Advanced indexing copies, so the read happens before the writes below (with
    # prev_num_emitted == bundle the read slot is also the slot written at the last position).
    state = _as(ssm_state[read], cd).view(R, HK, r, DK, DV)
    if B == 1:   # a decode step: the state updated in place, written once
        state.mul_(decay[0])
        state.addcmul_(k_col[0], beta[0] * (vs[0] - k_row[0] @ state))
        ssm_state.index_copy_(0, state_slots[:, 0], _as(state.view(R, HV, DK, DV), ssm_state.dtype))
        return _as((q_row[0] @ state).view(R, B, HV, DV), v.dtype)
    # A bundle: every token's state kept, then all of them written by one index_copy_ (a
    # request's bundle slots are distinct) and every output read by one batched matmul:
    # 5 ops per token instead of 8, the same arithmetic per element.
    states = []
    for t in range(B):
        # S = exp(g) S;  S += k (beta (v - k^T S));  o = q^T S
        state = state * decay[t]
        state = torch.addcmul(state, k_col[t], beta[t] * (vs[t] - k_row[t] @ state))
        states.append(state)
    states = torch.stack(states, 1)                                       # [R, B, HK, r, DK, DV]
    ssm_state.index_copy_(0, state_slots.flatten(), _as(states.view(R * B, HV, DK, DV), ssm_state.dtype))
    out = q.view(R, B, HK, 1, 1, DK) @ states                              # [R, B, HK, r, 1, DV]
    return _as(out.view(R, B, HV, DV), v.dtype)
