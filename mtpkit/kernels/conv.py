"""Pure-torch reference of the GDN depthwise causal conv1d + SiLU with a speculative conv
state: the "torch" backend's Ops.causal_conv1d_prefill / causal_conv1d_verify, and the oracle
for the Triton kernels in triton_conv.py (same names and signatures).

A slot of the pool holds conv_state_len = W - 1 + num_spec input columns. The W-1 inputs
that precede the next token (the "window") start at column offset prev_num_emitted - 1:

- verify (bundle = num_spec + 1 tokens x_0..x_{B-1} from window w): column j of the new
  state is column j + 1 of concat[w, x] (zero beyond). The state is written before the
  acceptance count a is known; this alignment puts the W-1 inputs ending at x_{a-1} at
  offset a-1 for every a, which is what the next step reads. With B = num_spec + 1 this is
  exactly "the last conv_state_len columns of concat[w, x]".
- prefill (any number of tokens): the state is the last conv_state_len columns of
  concat[w, x] (zero-padded on the left), i.e. the next window sits at offset
  conv_state_len - (W-1) = num_spec, the same as a verify step that accepted everything.
  Prefill reads its own initial window at that offset too.

Math runs in fp32 (fp64 for fp64 inputs); outputs are cast to x's dtype, stored columns to
the pool's dtype.
"""

import torch
import torch.nn.functional as F

from mtpkit.shapes import Bool, Float, Int, Tensor, checked
from mtpkit.step.metadata import StateSnapshots

__all__ = ["causal_conv1d_prefill", "causal_conv1d_prefill_rows", "causal_conv1d_verify", "write_conv_snapshots"]


def _compute_dtype(x: Float[Tensor, "..."]) -> torch.dtype:  # any shape: reads the dtype only
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _conv_silu(seq: Float[Tensor, "num_reqs conv_dim ctx_len"], weight: Float[Tensor, "conv_dim conv_width"]
               ) -> Float[Tensor, "num_reqs conv_dim q_len"]:
    """seq [R, C, W-1+T] (window then new inputs) -> silu(depthwise conv) [R, C, T].
    W taps summed over sliding windows: the depthwise F.conv1d has no fast fp64 CPU path
    (tens of ms for a tiny input)."""
    windows = seq.unfold(2, weight.shape[1], 1)                    # [R, C, T, W]
    w = weight if weight.dtype == seq.dtype else weight.to(seq.dtype)
    return F.silu((windows * w[:, None, :]).sum(-1))


def _conv_silu_taps(seq: Float[Tensor, "num_reqs conv_dim ctx_len"], weight: Float[Tensor, "conv_dim conv_width"]
                    ) -> Float[Tensor, "num_reqs conv_dim q_len"]:
    """_conv_silu as W shifted multiply-adds: from ~16 tokens faster on CPU than the windows'
    product and sum (~3x at 64; benchmarks/conv_prefill.py); a short prefill chunk keeps the
    four-op form. (causal_conv1d_verify sums its taps the same way, time-major.)"""
    W = weight.shape[1]
    T = seq.shape[2] - W + 1
    w = weight if weight.dtype == seq.dtype else weight.to(seq.dtype)
    acc = seq[..., :T] * w[:, :1]
    for j in range(1, W):
        acc.addcmul_(seq[..., j:j + T], w[:, j:j + 1])
    return F.silu(acc)


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
    """Varlen prefill: request i owns tokens [qsl[i], qsl[i+1]), starts from the window at
    offset conv_state_len - (W-1) of conv_state[slots[i]] (zeros when not
    has_initial_state[i]) and leaves the last conv_state_len columns of [window, x] there.
    `snapshots`: what a prefill ending at each snapshot's token would leave goes to
    snapshot_state[its id] (write_conv_snapshots). Returns silu(conv(x)) in x's dtype."""
    cd = _compute_dtype(x)
    W, L = weight.shape[1], conv_state.shape[2]
    if L < W - 1:
        raise ValueError(f"conv_state_len ({L}) must be at least conv_width - 1 ({W - 1})")
    has_init = has_initial_state.to(conv_state.device)
    # All windows are read before any slot is written, so the loop order cannot matter.
    windows = conv_state[torch.where(has_init, slots.long(), 0), :, L - (W - 1):].to(cd)
    windows = torch.where(has_init[:, None, None], windows, 0)
    xc = x.to(cd)
    out = xc.new_empty(xc.shape)
    new_states = []
    bounds = query_start_loc.tolist()
    for i in range(len(bounds) - 1):
        sl = slice(bounds[i], bounds[i + 1])
        seq = torch.cat([windows[i], xc[sl].T], dim=1)  # [C, W-1+T]
        if bounds[i + 1] > bounds[i]:  # conv1d rejects an input shorter than its kernel
            conv = _conv_silu_taps if bounds[i + 1] - bounds[i] >= 16 else _conv_silu
            out[sl] = conv(seq[None], weight)[0].T
        # Left zero-padding keeps the newest input in the last column whatever T is.
        new_states.append(F.pad(seq, (max(L - seq.shape[1], 0), 0))[:, -L:])
    if snapshots is not None:
        write_conv_snapshots(xc, windows, query_start_loc, snapshots, snapshot_state)
    if new_states:
        conv_state[slots.long()] = torch.stack(new_states).to(conv_state.dtype)
    return out.to(x.dtype)


@checked
def causal_conv1d_prefill_rows(
    x: Float[Tensor, "num_tokens conv_dim"],
    weight: Float[Tensor, "conv_dim conv_width"],
    conv_state: Float[Tensor, "num_slots conv_dim conv_state_len"],
    slots: Int[Tensor, "num_reqs_padded"],
    has_initial_state: Bool[Tensor, "num_reqs_padded"],
    num_real: Int[Tensor, "num_reqs_padded"],
    snapshots: StateSnapshots | None = None,
    snapshot_state: Float[Tensor, "snapshot_slots conv_dim conv_state_len"] | None = None,
) -> Float[Tensor, "num_tokens conv_dim"]:
    """causal_conv1d_prefill over rows of equal length (a captured prefill:
    step.metadata.PrefillRows): row i owns tokens [i*q_len, (i+1)*q_len), the first num_real[i]
    its chunk, the rest padding after it (which no real token's output reads: the conv is causal).
    The slot keeps what a prefill of the real tokens leaves: the last conv_state_len columns of
    [window, real inputs], gathered at num_real on the device (no host read: traceable);
    `snapshots` (token_index into these padded rows) as causal_conv1d_prefill's."""
    cd = _compute_dtype(x)
    W, L = weight.shape[1], conv_state.shape[2]
    R = slots.shape[0]
    T = x.shape[0] // R
    has_init = has_initial_state.to(conv_state.device)
    windows = conv_state[torch.where(has_init, slots, 0), :, L - (W - 1):].to(cd)
    windows = torch.where(has_init[:, None, None], windows, 0)
    seq = torch.cat([windows, x.to(cd).view(R, T, -1).transpose(1, 2)], dim=2)   # [R, C, W-1+T]
    out = (_conv_silu_taps if T >= 16 else _conv_silu)(seq, weight)                 # [R, C, T]
    if snapshots is not None:   # rows of T tokens: row i starts at token i*T
        write_conv_snapshots(x.to(cd), windows, torch.arange(R + 1, device=x.device) * T, snapshots, snapshot_state)
    # [zeros(L) | window | inputs]: the last L columns of [window, the first n inputs] start at W-1+n.
    ext = F.pad(seq, (L, 0))
    cols = (W - 1 + num_real)[:, None] + torch.arange(L, device=x.device)          # [R, L]
    conv_state[slots] = ext.gather(2, cols[:, None, :].expand(R, ext.shape[1], L)).to(conv_state.dtype)
    return out.transpose(1, 2).reshape(R * T, -1).to(x.dtype)


@checked
def write_conv_snapshots(
    x: Float[Tensor, "num_tokens conv_dim"],
    windows: Float[Tensor, "num_reqs conv_dim _"],
    query_start_loc: Int[Tensor, "num_reqs+1"],
    snapshots: StateSnapshots,
    snapshot_state: Float[Tensor, "snapshot_slots conv_dim conv_state_len"],
) -> None:
    """snapshot_state[id] = the last conv_state_len columns of [window of its row, the row's
    inputs up to its token] (zero-padded on the left): the conv state a prefill chunk ending
    at that token leaves. `windows`: each request's initial W-1 inputs (zeros without initial
    state), read before the prefill rewrote its slot. Gathers on the device, no host sync;
    shared by the torch and Triton prefills."""
    L, Wm1 = snapshot_state.shape[2], windows.shape[2]
    rows, tok = snapshots.rows, snapshots.token_index
    start = query_start_loc.to(x.device)[rows][:, None]
    src = tok[:, None] - (L - 1) + torch.arange(L, device=x.device)         # input index of each column
    from_x = src >= start
    col = Wm1 - (start - src)                                                # window column, before the chunk
    from_win = ~from_x & (col >= 0)
    xs = x[src.clamp(min=0)]                                                 # [n, L, C]
    ws = windows[rows[:, None], :, col.clamp(0, Wm1 - 1)] if Wm1 else torch.zeros_like(xs)
    val = torch.where(from_x[..., None], xs, torch.where(from_win[..., None], ws, 0))
    snapshot_state.index_copy_(0, snapshots.ids, val.transpose(1, 2).to(snapshot_state.dtype))


@checked
def causal_conv1d_verify(
    x: Float[Tensor, "num_reqs_padded bundle conv_dim"],
    weight: Float[Tensor, "conv_dim conv_width"],
    conv_state: Float[Tensor, "num_slots conv_dim conv_state_len"],
    slots: Int[Tensor, "num_reqs_padded"],
    prev_num_emitted: Int[Tensor, "num_reqs_padded"],
) -> Float[Tensor, "num_reqs_padded bundle conv_dim"]:
    """A uniform verify/decode step, batched over requests: request i's window starts at
    column prev_num_emitted[i] - 1 of conv_state[slots[i]]; afterwards column j of that slot
    holds column j + 1 of [window, x_i] (zeros past its end). Padded rows use slot 0 and
    prev_num_emitted 1. Returns silu(conv(x)) in x's dtype."""
    cd = _compute_dtype(x)
    R, B, C = x.shape
    W, L = weight.shape[1], conv_state.shape[2]
    if L < W - 1 + B - 1:
        raise ValueError(f"conv_state_len ({L}) must be at least conv_width - 1 + bundle - 1 "
                         f"({W - 1 + B - 1}) so that every prev_num_emitted in 1..bundle has a window")
    state = conv_state[slots]  # a copy: reads finish before the write below
    cols = torch.arange(W - 1, device=x.device) + (prev_num_emitted - 1)[:, None]
    window = state.gather(2, cols[:, None, :].expand(R, C, W - 1)).transpose(1, 2)   # [R, W-1, C]
    # Time-major ([R, time, C]): the output is token-major like x, so what reads a token's channels
    # (the GDN's q, k, v) reads them contiguously; a channel-major output made a compiled verify
    # graph's recurrence load v one strided scalar at a time (docs/performance.md).
    seq = torch.cat([window if window.dtype == cd else window.to(cd), x if x.dtype == cd else x.to(cd)],
                    dim=1)                                                   # [R, W-1+B, C]
    new_state = seq[:, 1:1 + L]
    if new_state.shape[1] < L:
        new_state = F.pad(new_state, (0, 0, 0, L - new_state.shape[1]))
    new_state = new_state.transpose(1, 2)                                    # [R, C, L]
    conv_state[slots] = new_state if new_state.dtype == conv_state.dtype else new_state.to(conv_state.dtype)
    w = (weight if weight.dtype == cd else weight.to(cd)).t()                 # [W, C]
    if torch.compiler.is_compiling():   # a constant of the graph: each tap's weights then contiguous
        w = w.contiguous()
    acc = seq[:, :B] * w[0]                        # the W taps, summed as _conv_silu_taps sums them
    for j in range(1, W):
        acc.addcmul_(seq[:, j:j + B], w[j])
    out = F.silu(acc)
    return out if out.dtype == x.dtype else out.to(x.dtype)
