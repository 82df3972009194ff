"""Triton kernels of the gated delta rule (Gated DeltaNet), beside their torch references in
gdn.py. Same signatures, same semantics; tested against the references under
TRITON_INTERPRET=1 (tests/test_triton_kernels.py).

Verify / decode (`gated_delta_rule_verify`): ONE launch per layer and step over
[num_reqs_padded, bundle] tokens. Grid (num_reqs_padded, v_heads, cdiv(v_dim, BV)); a program
keeps a [k_dim, BV] tile of its request's state in registers (fp32):

- reads the initial state from ssm_state[state_slots[r, prev_num_emitted[r] - 1]] (every read
  of a tile happens before any write of the same tile, and only this program touches that
  tile, so the read slot may also be a written slot);
- per bundle token t (unrolled): q/k L2 normalisation (eps inside the rsqrt) and q scaling,
  GQA head repetition (value head h reads key head h // (v_heads // k_heads)),
  g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the decay, the delta-rule
  update and the output, all fused;
- writes the state after token t to ssm_state[state_slots[r, t]].

The null slot 0 is never written: padded rows (every slot 0, prev_num_emitted 1) read slot 0 and
compute finite garbage outputs like the reference does, but leave the pool untouched. (The
reference writes slot 0; with several padded rows those writes would race on a GPU. The
outputs of all rows are identical to the reference's as long as slot 0 is what it was
before the step; the pool is allocated zeroed and this backend never writes slot 0.)

Prefill (`gated_delta_rule_prefill`): on CUDA with fla-core importable, fla's
`chunk_gated_delta_rule` (varlen via cu_seqlens, q/k L2 norm in kernel). Otherwise an own
Triton kernel: the same recurrence token by token per (request, value head, value block),
parallel over requests and heads, sequential over tokens (no chunking). A requested state
snapshot (metadata.StateSnapshots) is stored as the loop passes its token (fla is not used
then: it keeps no state inside a sequence). Initial states are
gathered into a scratch buffer first, so a request's read slot may be another request's
write slot (the reference's "all reads before any write" holds). The kernels compute in fp32:
triton_common.use_reference's rule (fp64) sends a call to the torch reference.

All launch configurations are fixed (no autotuning), so nothing is benchmarked inside a
CUDA graph capture; every shape should still be run once before capture (Triton compiles
per specialisation).
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mtpkit.shapes import Bool, Float, Int, Tensor, checked
from mtpkit.step.metadata import StateSnapshots

from mtpkit.kernels import gdn as ref
from mtpkit.kernels.triton_common import use_reference

__all__ = ["gated_delta_rule_prefill", "gated_delta_rule_verify", "fla_available"]


_FLA = None


def fla_available() -> bool:
    """fla-core's chunked kernel is usable (imported lazily, once)."""
    global _FLA
    if _FLA is None:
        if os.environ.get("MTPKIT_USE_FLA", "1").strip() in ("0", "false", "no"):
            _FLA = False
        else:
            try:
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
                _FLA = True
            except Exception:  # ImportError, or a broken install
                _FLA = False
    return _FLA


# ---------------------------------------------------------------------------------------
# kernels


@triton.jit
def _softplus(x):
    # torch's softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _gdn_step(S, q, k, v, a, b, A, dt_bias, scale):
    """One token: q, k raw [BK] fp32; v [BV]; a, b scalars. Returns (o [BV], S')."""
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    g = -A * _softplus(a + dt_bias)
    beta = tl.sigmoid(b)
    S = S * tl.exp(g)
    predicted = tl.sum(S * k[:, None], axis=0)
    delta = beta * (v - predicted)
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    return o, S


@triton.jit
def _gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, acc_ptr, o_ptr,
    sq_r, sq_t, sq_h, sq_d,
    sk_r, sk_t, sk_h, sk_d,
    sv_r, sv_t, sv_h, sv_d,
    sa_r, sa_t, sa_h,
    sb_r, sb_t, sb_h,
    ss_s, ss_h, ss_k, ss_v,
    sl_r, sl_t,
    so_r, so_t, so_h,
    scale,
    BUNDLE: tl.constexpr, GQA: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vb = tl.program_id(2)
    hk = h // GQA
    offk = tl.arange(0, BK)
    offv = vb * BV + tl.arange(0, BV)
    mk = offk < DK
    mv = offv < DV
    mkv = mk[:, None] & mv[None, :]
    tile = h * ss_h + offk[:, None].to(tl.int64) * ss_k + offv[None, :].to(tl.int64) * ss_v

    n_acc = tl.load(acc_ptr + r).to(tl.int64)
    read_slot = tl.load(slots_ptr + r * sl_r + (n_acc - 1) * sl_t).to(tl.int64)
    S = tl.load(state_ptr + read_slot * ss_s + tile, mask=mkv, other=0.0).to(tl.float32)
    A = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in tl.static_range(BUNDLE):
        q = tl.load(q_ptr + r * sq_r + t * sq_t + hk * sq_h + offk * sq_d, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + r * sk_r + t * sk_t + hk * sk_h + offk * sk_d, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r * sv_r + t * sv_t + h * sv_h + offv * sv_d, mask=mv, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + r * sa_r + t * sa_t + h * sa_h).to(tl.float32)
        b = tl.load(b_ptr + r * sb_r + t * sb_t + h * sb_h).to(tl.float32)
        o, S = _gdn_step(S, q, k, v, a, b, A, dt_bias, scale)
        tl.store(o_ptr + r * so_r + t * so_t + h * so_h + offv, o.to(o_ptr.dtype.element_ty), mask=mv)
        write_slot = tl.load(slots_ptr + r * sl_r + t * sl_t).to(tl.int64)
        # The null slot is never written (padded rows leave the pool untouched). The scalar
        # condition is broadcast by hand: the interpreter rejects a block & scalar mask.
        not_null = (offv * 0 + write_slot) != 0
        tl.store(state_ptr + write_slot * ss_s + tile, S.to(state_ptr.dtype.element_ty),
                 mask=mkv & not_null[None, :])


@triton.jit
def _gdn_prefill_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, init_ptr, state_ptr, qsl_ptr,
    wslots_ptr, o_ptr, snap_of_ptr, snap_ptr,
    sq_t, sq_h, sq_d,
    sk_t, sk_h, sk_d,
    sv_t, sv_h, sv_d,
    sa_t, sa_h,
    sb_t, sb_h,
    ss_s, ss_h, ss_k, ss_v,
    sn_s, sn_h, sn_k, sn_v,
    so_t, so_h,
    scale,
    GQA: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_SNAP: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vb = tl.program_id(2)
    hk = h // GQA
    offk = tl.arange(0, BK)
    offv = vb * BV + tl.arange(0, BV)
    mk = offk < DK
    mv = offv < DV
    mkv = mk[:, None] & mv[None, :]
    # init: contiguous [num_reqs, v_heads, DK, DV] fp32 (zeros where no initial state)
    init_off = ((i * tl.num_programs(1) + h) * DK + offk[:, None]) * DV + offv[None, :]
    S = tl.load(init_ptr + init_off, mask=mkv, other=0.0)
    A = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    start = tl.load(qsl_ptr + i).to(tl.int64)
    end = tl.load(qsl_ptr + i + 1).to(tl.int64)
    for t in range(start, end):
        q = tl.load(q_ptr + t * sq_t + hk * sq_h + offk * sq_d, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * sk_t + hk * sk_h + offk * sk_d, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + offv * sv_d, mask=mv, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + t * sa_t + h * sa_h).to(tl.float32)
        b = tl.load(b_ptr + t * sb_t + h * sb_h).to(tl.float32)
        o, S = _gdn_step(S, q, k, v, a, b, A, dt_bias, scale)
        tl.store(o_ptr + t * so_t + h * so_h + offv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if HAS_SNAP:
            # snap_of[t]: the snapshot row that receives the state after token t, or -1.
            sid = tl.load(snap_of_ptr + t).to(tl.int64)
            wanted = (offv * 0 + sid) >= 0     # broadcast by hand (the interpreter's scalar masks)
            snap_tile = h * sn_h + offk[:, None].to(tl.int64) * sn_k + offv[None, :].to(tl.int64) * sn_v
            tl.store(snap_ptr + tl.maximum(sid, 0) * sn_s + snap_tile, S.to(snap_ptr.dtype.element_ty),
                     mask=mkv & wanted[None, :])
    w = tl.load(wslots_ptr + i).to(tl.int64)
    tile = h * ss_h + offk[:, None].to(tl.int64) * ss_k + offv[None, :].to(tl.int64) * ss_v
    tl.store(state_ptr + w * ss_s + tile, S.to(state_ptr.dtype.element_ty), mask=mkv)


def _blocks(k_dim: int, v_dim: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps): the whole key dim per program, value dim in blocks of <= 32."""
    BK = triton.next_power_of_2(k_dim)
    BV = min(triton.next_power_of_2(v_dim), 32)
    return BK, BV, 4 if BK * BV <= 4096 else 8


# ---------------------------------------------------------------------------------------
# entry points


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
    """Triton version of gdn.gated_delta_rule_verify (one launch; see the module docstring).
    Differs only in never writing the null slot 0."""
    if use_reference(__name__, q, k, v, ssm_state):
        return ref.gated_delta_rule_verify(q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots,
                                           prev_num_emitted)
    R, B, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"v_heads ({HV}) must be a multiple of k_heads ({HK})")
    out = torch.empty(R, B, HV, DV, dtype=v.dtype, device=v.device)
    if R == 0:
        return out
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    prev_num_emitted = prev_num_emitted.contiguous()
    BK, BV, warps = _blocks(DK, DV)
    grid = (R, HV, triton.cdiv(DV, BV))
    _gdn_verify_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots, prev_num_emitted, out,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *ssm_state.stride(),
        *state_slots.stride(), *out.stride()[:3],
        DK ** -0.5,
        BUNDLE=B, GQA=HV // HK, DK=DK, DV=DV, BK=BK, BV=BV, num_warps=warps,
    )
    return out


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
    """gdn.gated_delta_rule_prefill on GPU: fla-core's chunked kernel when importable (CUDA
    only) and no snapshot is asked for, else this module's recurrent varlen Triton kernel
    (chunk_size is then unused), which stores the state after each snapshot's token as it
    passes it. fp64 goes to the torch reference (triton_common.use_reference)."""
    if use_reference(__name__, q, k, v, ssm_state):
        return ref.gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, ssm_state, query_start_loc,
                                            read_slots, write_slots, has_initial_state, chunk_size,
                                            snapshots, snapshot_state)
    T, HK, DK = q.shape
    HV, DV = v.shape[1], v.shape[2]
    R = read_slots.shape[0]
    if HV % HK:
        raise ValueError(f"v_heads ({HV}) must be a multiple of k_heads ({HK})")
    if R == 0:
        return torch.empty(T, HV, DV, dtype=v.dtype, device=v.device)
    has_init = has_initial_state.to(ssm_state.device)
    # All initial states are gathered before any final state is written.
    init = ssm_state[torch.where(has_init, read_slots.long(), 0)].to(torch.float32)
    init = torch.where(has_init[:, None, None, None], init, 0).contiguous()
    if q.device.type == "cuda" and fla_available() and snapshots is None:
        return _prefill_fla(q, k, v, a, b, A_log, dt_bias, ssm_state, query_start_loc, write_slots, init)
    out = torch.empty(T, HV, DV, dtype=v.dtype, device=v.device)
    BK, BV, warps = _blocks(DK, DV)
    grid = (R, HV, triton.cdiv(DV, BV))
    if snapshots is None:   # unused pointers (HAS_SNAP is off): any tensor
        snap_of, snap = out, ssm_state
    else:
        snap_of = torch.full((T,), -1, dtype=torch.int64, device=q.device)
        snap_of[snapshots.token_index] = snapshots.ids
        snap = snapshot_state
    _gdn_prefill_kernel[grid](
        q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), init, ssm_state,
        query_start_loc.contiguous(), write_slots.contiguous(), out, snap_of, snap,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *ssm_state.stride(),
        *snap.stride(), *out.stride()[:2],
        DK ** -0.5,
        GQA=HV // HK, DK=DK, DV=DV, BK=BK, BV=BV, HAS_SNAP=snapshots is not None, num_warps=warps,
    )
    return out


def _prefill_fla(q, k, v, a, b, A_log, dt_bias, ssm_state, query_start_loc, write_slots, init):
    """fla-core's chunk_gated_delta_rule over the packed batch (cu_seqlens = query_start_loc).
    Heads are repeated to v_heads here (fla versions differ in GQA support); g and beta are
    computed in fp32 exactly as gdn_prepare does; q/k are normalised inside fla's kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    HK, DK, HV = q.shape[1], q.shape[2], v.shape[1]
    r = HV // HK
    dtype = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    qr = q.to(dtype).repeat_interleave(r, dim=1)[None]
    kr = k.to(dtype).repeat_interleave(r, dim=1)[None]
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    o, final = chunk_gated_delta_rule(
        qr, kr, v.to(dtype)[None], g[None], beta.to(dtype)[None], scale=DK ** -0.5,
        initial_state=init, output_final_state=True, cu_seqlens=query_start_loc.long(),
        use_qk_l2norm_in_kernel=True)
    ssm_state[write_slots.long()] = final.to(ssm_state.dtype)
    return o[0].to(v.dtype)
