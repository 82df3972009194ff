"""Triton kernels of the GDN depthwise causal conv1d + SiLU with the speculative conv state,
beside their torch references in conv.py (same signatures and semantics; tested against
them under TRITON_INTERPRET=1).

Notation: W = conv_width, L = conv_state_len (>= W - 1), a slot's columns hold past inputs.

Verify / bundle update (`causal_conv1d_verify`), one launch, grid
(num_reqs_padded, cdiv(conv_dim, BLOCK_C)). A program owns BLOCK_C channels of one request.
It views seq = [window, x_0..x_{B-1}], window = columns prev_num_emitted-1 .. prev_num_emitted+W-3
of the request's slot, and gathers straight from memory:
  - a [BLOCK_C, SEQ] tile of seq (for the outputs: out_t = silu(sum_w weight[:, w] * seq[t+w]),
    the weight loaded shifted by t so the sum is one masked row-reduction per token),
  - a [BLOCK_C, L] tile of the new state, column j = seq[j + 1] (zeros past the end),
then stores. All reads of the slot precede all writes, and only this program touches these
channels of the slot. The null slot 0 is never written (padded rows compute outputs from it
like the reference but leave it untouched, so several padded rows cannot race on it).

Varlen prefill (`causal_conv1d_prefill`): two launches. (1) outputs, grid
(cdiv(num_tokens, BLOCK_T), cdiv(conv_dim, BLOCK_C)): token t of request i (found from a
token -> request map built with torch.searchsorted on the device, no host sync) sums
weight[:, w] * input[t - (W-1) + w], where inputs before the request's first token come
from its initial window (columns L-(W-1).. of its slot, zeros without initial state).
(2) states, grid (num_reqs, cdiv(conv_dim, BLOCK_C)): the last L columns of
[window, x_i] (zero-padded on the left). The state launch runs after the output launch
on the same stream, so every window is read before any slot is rewritten.

Math in fp32; triton_common.use_reference's rule (fp64) sends a call to the torch reference.
Fixed launch configurations.
"""


import torch
import triton
import triton.language as tl

from mtpkit.shapes import Bool, Float, Int, Tensor, checked
from mtpkit.step.metadata import StateSnapshots

from mtpkit.kernels import conv as ref
from mtpkit.kernels.triton_common import use_reference

__all__ = ["causal_conv1d_prefill", "causal_conv1d_verify"]


BLOCK_C = 128


@triton.jit
def _gather_seq(x_ptr, state_ptr, r, slot, first, s, offc, mc,
                sx_r, sx_t, sx_c, ss_s, ss_c, ss_l,
                W: tl.constexpr, B: tl.constexpr):
    """seq[c, s] for a [BLOCK_C, S] index tile s: window column first + s for s < W-1, else
    x[r, s - (W-1), c]; zero past the end (s >= W-1+B)."""
    in_win = s < W - 1
    in_x = (s >= W - 1) & (s < W - 1 + B)
    col = tl.where(in_win, first + s, 0)
    win = tl.load(state_ptr + slot * ss_s + offc[:, None] * ss_c + col[None, :] * ss_l,
                  mask=mc[:, None] & in_win[None, :], other=0.0)
    t = tl.where(in_x, s - (W - 1), 0)
    xs = tl.load(x_ptr + r * sx_r + t[None, :] * sx_t + offc[:, None] * sx_c,
                 mask=mc[:, None] & in_x[None, :], other=0.0)
    return win.to(tl.float32) + xs.to(tl.float32)


@triton.jit
def _conv_verify_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, acc_ptr, o_ptr,
    sx_r, sx_t, sx_c,
    sw_c, sw_w,
    ss_s, ss_c, ss_l,
    so_r, so_t, so_c,
    C,
    W: tl.constexpr, B: tl.constexpr, L: tl.constexpr, SEQ: tl.constexpr, LP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offc < C
    slot = tl.load(slots_ptr + r).to(tl.int64)
    first = tl.load(acc_ptr + r).to(tl.int64) - 1
    s = tl.arange(0, SEQ)
    seq = _gather_seq(x_ptr, state_ptr, r, slot, first, s, offc, mc,
                      sx_r, sx_t, sx_c, ss_s, ss_c, ss_l, W, B)
    j = tl.arange(0, LP)
    new_state = _gather_seq(x_ptr, state_ptr, r, slot, first, j + 1, offc, mc,
                            sx_r, sx_t, sx_c, ss_s, ss_c, ss_l, W, B)
    for t in tl.static_range(B):
        wi = s - t  # seq column s meets weight tap s - t
        wmask = (wi >= 0) & (wi < W)
        wt = tl.load(w_ptr + offc[:, None] * sw_c + tl.where(wmask, wi, 0)[None, :] * sw_w,
                     mask=mc[:, None] & wmask[None, :], other=0.0).to(tl.float32)
        y = tl.sum(seq * wt, axis=1)
        y = y * tl.sigmoid(y)
        tl.store(o_ptr + r * so_r + t * so_t + offc * so_c, y.to(o_ptr.dtype.element_ty), mask=mc)
    not_null = (j * 0 + slot) != 0
    tl.store(state_ptr + slot * ss_s + offc[:, None] * ss_c + j[None, :] * ss_l,
             new_state.to(state_ptr.dtype.element_ty),
             mask=mc[:, None] & ((j < L) & not_null)[None, :])


@triton.jit
def _conv_prefill_out_kernel(
    x_ptr, w_ptr, state_ptr, qsl_ptr, req_ptr, slots_ptr, init_ptr, o_ptr,
    sx_t, sx_c,
    sw_c, sw_w,
    ss_s, ss_c, ss_l,
    so_t, so_c,
    T, C,
    W: tl.constexpr, L: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    offt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt = offt < T
    mc = offc < C
    req = tl.load(req_ptr + offt, mask=mt, other=0).to(tl.int64)
    start = tl.load(qsl_ptr + req, mask=mt, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + req, mask=mt, other=0).to(tl.int64)
    has_init = tl.load(init_ptr + req, mask=mt, other=0) != 0
    offt64 = offt.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for w in tl.static_range(W):
        src = offt64 - (W - 1) + w           # input token index (global)
        from_x = src >= start
        # Before the request's first token: window column L - (W-1) + (position in seq).
        col = L - (W - 1) + (src - start + (W - 1))
        from_win = (~from_x) & has_init & mt
        xs = tl.load(x_ptr + tl.where(from_x, src, 0)[:, None] * sx_t + offc[None, :] * sx_c,
                     mask=(from_x & mt)[:, None] & mc[None, :], other=0.0).to(tl.float32)
        ws = tl.load(state_ptr + slot[:, None] * ss_s + offc[None, :] * ss_c
                     + tl.where(from_win, col, 0)[:, None] * ss_l,
                     mask=from_win[:, None] & mc[None, :], other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + offc * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
        acc += (xs + ws) * wt[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(o_ptr + offt64[:, None] * so_t + offc[None, :] * so_c, y.to(o_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_prefill_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slots_ptr, init_ptr,
    sx_t, sx_c,
    ss_s, ss_c, ss_l,
    C,
    W: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    offc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offc < C
    start = tl.load(qsl_ptr + i).to(tl.int64)
    n = tl.load(qsl_ptr + i + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + i).to(tl.int64)
    j = tl.arange(0, LP)
    # Scalar conditions are broadcast by hand: the interpreter rejects a block & scalar mask.
    has_init = (j * 0 + tl.load(init_ptr + i)) != 0
    s = (W - 1 + n) - L + j                  # index into [window, x_i]
    in_x = s >= W - 1
    in_win = (s >= 0) & (s < W - 1) & has_init
    xs = tl.load(x_ptr + (start + tl.where(in_x, s - (W - 1), 0))[None, :] * sx_t + offc[:, None] * sx_c,
                 mask=mc[:, None] & (in_x & (j < L))[None, :], other=0.0)
    win = tl.load(state_ptr + slot * ss_s + offc[:, None] * ss_c
                  + tl.where(in_win, L - (W - 1) + s, 0)[None, :] * ss_l,
                  mask=mc[:, None] & (in_win & (j < L))[None, :], other=0.0)
    new = xs.to(tl.float32) + win.to(tl.float32)
    tl.store(state_ptr + slot * ss_s + offc[:, None] * ss_c + j[None, :] * ss_l,
             new.to(state_ptr.dtype.element_ty), mask=mc[:, None] & (j < L)[None, :])


@checked
def causal_conv1d_verify(
    x: Float[Tensor, "num_reqs_padded bundle conv_dim"],
    weight: Float[Tensor, "conv_dim conv_width"],
    conv_state: Float[Tensor, "num_slots conv_dim conv_state_len"],
    slots: Int[Tensor, "num_reqs_padded"],
    prev_num_emitted: Int[Tensor, "num_reqs_padded"],
) -> Float[Tensor, "num_reqs_padded bundle conv_dim"]:
    """Triton version of conv.causal_conv1d_verify (see the module docstring); differs
    only in never writing the null slot 0."""
    if use_reference(__name__, x, conv_state):
        return ref.causal_conv1d_verify(x, weight, conv_state, slots, prev_num_emitted)
    R, B, C = x.shape
    W, L = weight.shape[1], conv_state.shape[2]
    if L < W - 1 + B - 1:
        raise ValueError(f"conv_state_len ({L}) must be at least conv_width - 1 + bundle - 1 "
                         f"({W - 1 + B - 1}) so that every prev_num_emitted in 1..bundle has a window")
    out = torch.empty(R, B, C, dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    grid = (R, triton.cdiv(C, BLOCK_C))
    _conv_verify_kernel[grid](
        x, weight, conv_state, slots.contiguous(), prev_num_emitted.contiguous(), out,
        *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(), C,
        W=W, B=B, L=L, SEQ=triton.next_power_of_2(W - 1 + B), LP=triton.next_power_of_2(L),
        BLOCK_C=BLOCK_C, num_warps=4,
    )
    return out


@checked
def causal_conv1d_prefill(
    x: Float[Tensor, "num_tokens conv_dim"],
    weight: Float[Tensor, "conv_dim conv_width"],
    conv_state: Float[Tensor, "num_slots conv_dim conv_state_len"],
    query_start_loc: Int[Tensor, "num_reqs+1"],
    slots: Int[Tensor, "num_reqs"],
    has_initial_state: Bool[Tensor, "num_reqs"],
    snapshots: StateSnapshots | None = None,
    snapshot_state: Float[Tensor, "snapshot_slots conv_dim conv_state_len"] | None = None,
) -> Float[Tensor, "num_tokens conv_dim"]:
    """Triton version of conv.causal_conv1d_prefill (see the module docstring); the state
    snapshots are torch gathers (ref.write_conv_snapshots) from the windows read first."""
    if use_reference(__name__, x, conv_state):
        return ref.causal_conv1d_prefill(x, weight, conv_state, query_start_loc, slots, has_initial_state,
                                         snapshots, snapshot_state)
    T, C = x.shape
    W, L = weight.shape[1], conv_state.shape[2]
    if L < W - 1:
        raise ValueError(f"conv_state_len ({L}) must be at least conv_width - 1 ({W - 1})")
    R = slots.shape[0]
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    qsl = query_start_loc.to(device=x.device).contiguous()
    slots = slots.to(device=x.device).contiguous()
    init = has_initial_state.to(device=x.device, dtype=torch.int32).contiguous()
    if snapshots is not None:   # the initial windows, before the state launch rewrites the slots
        windows = torch.where(init[:, None, None] != 0, conv_state[slots.long(), :, L - (W - 1):].float(), 0)
    if T > 0:
        # Request of every token: the last i with qsl[i] <= t (empty requests are skipped).
        tok = torch.arange(T, device=x.device, dtype=qsl.dtype)
        req = (torch.searchsorted(qsl, tok, right=True) - 1).to(torch.int32)
        BLOCK_T = 16
        _conv_prefill_out_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C))](
            x, weight, conv_state, qsl, req, slots, init, out,
            *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(), T, C,
            W=W, L=L, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4,
        )
    _conv_prefill_state_kernel[(R, triton.cdiv(C, BLOCK_C))](
        x, conv_state, qsl, slots, init,
        *x.stride(), *conv_state.stride(), C,
        W=W, L=L, LP=triton.next_power_of_2(L), BLOCK_C=BLOCK_C, num_warps=4,
    )
    if snapshots is not None:
        ref.write_conv_snapshots(x.float(), windows, qsl, snapshots, snapshot_state)
    return out
