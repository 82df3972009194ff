"""Pure-torch reference of paged full attention (causal, GQA, optional sliding window and
logit softcap): the "torch" backend's Ops.write_kv / paged_attention_prefill /
paged_attention_verify / verify_gather, and the oracle for the Triton kernels in
triton_paged.py (same names and signatures).

KV pool per layer: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; block 0 is
the null block. Position p of request i lives in block block_table[i, p // block_size] at
offset p % block_size (slot id = block * block_size + offset); with a sliding window the
table may hold only the blocks the window reads (engine/kv_pools.py: the entries below are
the null block, and nothing below the window is gathered). The KV of the step's own
tokens must already be in the pool (`write_kv`) before attention runs. A request's new
tokens are the last q_len positions of its context: seq_len - q_len .. seq_len - 1.

Scores and softmax run in fp32 (fp64 for fp64 inputs); the output is cast to q's dtype.
"""

import torch
import torch.nn.functional as F

from mtpkit.shapes import Bool, Float, Int, Tensor, checked

__all__ = ["write_kv", "paged_attention_prefill", "paged_attention_verify"]


@checked
def write_kv(
    k: Float[Tensor, "num_tokens kv_heads head_dim"],
    v: Float[Tensor, "num_tokens kv_heads head_dim"],
    k_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
    v_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
    slot_mapping: Int[Tensor, "num_tokens"],
) -> None:
    """Store each token's K/V at its slot id (in place, in the cache's dtype)."""
    slot_mapping = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = x if x.dtype == cache.dtype else x.to(cache.dtype)
        if cache.is_contiguous():  # slot id = row of the flattened pool
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)
        else:
            block_size = cache.shape[1]
            cache[slot_mapping // block_size, slot_mapping % block_size] = x


def _gather_kv(k_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
               v_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
               block_table: Int[Tensor, "num_reqs max_blocks"], seq_lens: Int[Tensor, "num_reqs"], ctx_len: int
               ) -> tuple[Float[Tensor, "num_reqs ctx_len kv_heads head_dim"],
                          Float[Tensor, "num_reqs ctx_len kv_heads head_dim"]]:
    """Dense K and V of positions 0..ctx_len-1 of every request. Positions at or past a
    request's seq_len read its last real position instead (any value would do: attention
    masks them), so the gather never touches storage the request does not own or has not
    written, which may hold anything (even NaN: 0 * NaN would leak through the softmax
    product)."""
    return gather_slots(k_cache, v_cache, context_slots(block_table, seq_lens - 1, k_cache.shape[1], ctx_len))


def context_slots(block_table: Int[Tensor, "num_reqs max_blocks"], last_pos: Int[Tensor, "num_reqs"],
                  block_size: int, ctx_len: int, first_pos: Int[Tensor, "num_reqs"] | None = None
                  ) -> Int[Tensor, "num_reqs ctx_len"]:
    """The cache slot of positions 0..ctx_len-1 of every request, positions past last_pos
    reading last_pos's slot and positions before first_pos (when given: the first key a
    sliding window reads) first_pos's: storage the request owns, which attention masks. Not
    checked itself (every attention call makes one): its callers at the boundaries are."""
    pos = torch.minimum(torch.arange(ctx_len, device=block_table.device), last_pos[:, None])  # [R, ctx]
    if first_pos is not None:
        pos = torch.maximum(pos, first_pos[:, None])
    return block_table.gather(1, pos // block_size) * block_size + pos % block_size


def _gather_window(k_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
                   v_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
                   block_table: Int[Tensor, "num_reqs max_blocks"], first: Int[Tensor, "num_reqs"],
                   last: Int[Tensor, "num_reqs"], span: int
                   ) -> tuple[Float[Tensor, "num_reqs ctx_len kv_heads head_dim"],
                              Float[Tensor, "num_reqs ctx_len kv_heads head_dim"], Int[Tensor, "num_reqs ctx_len"]]:
    """K, V and positions of the `span` positions first .. first + span - 1 of every request (a
    sliding window's keys: the whole context need not be gathered), positions past `last`
    reading last's slot (masked: they lie after every query)."""
    k_pos = first[:, None] + torch.arange(span, device=first.device)                    # [R, span]
    pos = torch.minimum(k_pos, last[:, None])
    bs = k_cache.shape[1]
    slots = block_table.gather(1, pos // bs) * bs + pos % bs
    kk, vv = gather_slots(k_cache, v_cache, slots)
    return kk, vv, k_pos


def window_start(first_query: Int[Tensor, "num_reqs"], sliding_window: int | None) -> Int[Tensor, "num_reqs"] | None:
    """The first key a row whose earliest query is at `first_query` reads (None: no window)."""
    if sliding_window is None:
        return None
    return (first_query - (sliding_window - 1)).clamp(min=0)


def gather_slots(k_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
                  v_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
                  slots: Int[Tensor, "num_reqs ctx_len"]
                  ) -> tuple[Float[Tensor, "num_reqs ctx_len kv_heads head_dim"],
                             Float[Tensor, "num_reqs ctx_len kv_heads head_dim"]]:
    """Dense K and V at the cache slots `slots` (each row's slot of every context position).
    Not checked itself (every torch attention call makes one): its callers at the boundaries are."""
    flat = slots.reshape(-1)
    # One flat gather (index_select) instead of 2-D advanced indexing: cheaper per call.
    kk = k_cache.reshape(-1, *k_cache.shape[2:]).index_select(0, flat)
    vv = v_cache.reshape(-1, *v_cache.shape[2:]).index_select(0, flat)
    shape = tuple(slots.shape) + tuple(k_cache.shape[2:])
    return kk.view(shape), vv.view(shape)


def _attend(q: Float[Tensor, "num_reqs q_len heads head_dim"], k: Float[Tensor, "num_reqs ctx_len kv_heads head_dim"],
            v: Float[Tensor, "num_reqs ctx_len kv_heads head_dim"], q_pos: Int[Tensor, "num_reqs q_len"],
            scale: float, sliding_window: int | None, softcap: float | None,
            k_pos: Int[Tensor, "num_reqs ctx_len"] | None = None
            ) -> Float[Tensor, "num_reqs q_len heads head_dim"]:
    """q [R, Q, H, D] at positions q_pos [R, Q]; k, v [R, K, KVH, D] at positions 0..K-1, or
    at k_pos [R, K] (a sliding window's gather). Causal: a query at p sees keys up to p, which
    are all real. Returns [R, Q, H, D] in q's dtype."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    k_pos = torch.arange(k.shape[1], device=q.device) if k_pos is None else k_pos[:, None, :]
    visible = k_pos <= q_pos[:, :, None]                                                # [R, Q, K]
    if sliding_window is not None:
        visible &= k_pos > q_pos[:, :, None] - sliding_window
    if torch.compiler.is_compiling() and q.shape[1] == 1:
        return _attend_fused(q, k, v, visible, scale, softcap, cd)
    qh, kh, vh = ((x if x.dtype == cd else x.to(cd)).transpose(1, 2) for x in (q, k, v))  # [R, heads, *, D]
    if softcap is None:
        # Query head h reads KV head h // (heads // kv_heads) (enable_gqa groups them so).
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible[:, None], scale=scale,
                                             enable_gqa=bool(heads != kv_heads))
    else:
        kh = kh.repeat_interleave(heads // kv_heads, dim=1)
        vh = vh.repeat_interleave(heads // kv_heads, dim=1)
        scores = (qh @ kh.transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        out = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1) @ vh
    out = out.transpose(1, 2)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _attend_fused(q: Float[Tensor, "num_reqs q_len heads head_dim"], k: Float[Tensor, "num_reqs ctx_len kv_heads head_dim"],
                  v: Float[Tensor, "num_reqs ctx_len kv_heads head_dim"], visible: Bool[Tensor, "num_reqs q_len ctx_len"],
                  scale: float, softcap: float | None, cd: torch.dtype) -> Float[Tensor, "num_reqs q_len heads head_dim"]:
    """_attend in a compiled graph of one query per row (a drafter's one-token pass, a decode step
    without drafts): two batched matmuls and a softmax, compiled by inductor with the graph, where
    scaled_dot_product_attention is an extern call whose set-up costs more than one query's work
    (13 vs ~30 us per call measured for the multiply + sum form this replaced). A bundle of 4
    queries ran slower that way than through the extern call (163 vs 75 us with its neighbours),
    so it keeps that: docs/performance.md, "Inside the aot-tuned graphs". Equal up to rounding."""
    R, Q, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH                                          # query head h reads KV head h // G
    # Both products as batched matmuls over materialised operands. Written as multiply + sum,
    # inductor fused q's RoPE into the scores' loop and the scores and softmax into the values' sum,
    # recomputing them per key and per output element (1.4 ms of a 4.5 ms Gemma 4 assistant
    # proposal at head_dim 128, 128 keys: benchmarks/aot_kernel_profile.py --model tiny-gemma4).
    qh = q.to(cd).view(R, Q, KVH, G, D).permute(0, 2, 1, 3, 4).reshape(R, KVH, Q * G, D)
    scores = (qh @ k.to(cd).permute(0, 2, 3, 1)).view(R, KVH, Q, G, -1) * scale        # [R, KVH, Q, G, K]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    p = torch.softmax(scores.masked_fill(~visible[:, None, :, None, :], float("-inf")), dim=-1)
    out = p.view(R, KVH, Q * G, -1) @ v.to(cd).transpose(1, 2)                          # [R, KVH, Q * G, D]
    out = out.view(R, KVH, Q, G, D).permute(0, 2, 1, 3, 4).reshape(R, Q, H, D)
    return out if out.dtype == q.dtype else out.to(q.dtype)


@checked
def paged_attention_prefill(
    q: Float[Tensor, "num_tokens heads head_dim"],
    k_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
    v_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
    query_start_loc: Int[Tensor, "num_reqs+1"],
    seq_lens: Int[Tensor, "num_reqs"],
    block_table: Int[Tensor, "num_reqs max_blocks"],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Float[Tensor, "num_tokens heads head_dim"]:
    """Varlen prefill (a chunk, possibly after a cached prefix): request i's queries are
    tokens [qsl[i], qsl[i+1]) at positions seq_lens[i] - q_len .. seq_lens[i] - 1; query
    at p sees keys 0..p (only p - sliding_window < key <= p with a window);
    scores = softcap * tanh(scores / softcap) before masking when softcap is given."""
    out = q.new_empty(q.shape)
    bounds = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i in range(len(lens)):
        start, end, ctx = bounds[i], bounds[i + 1], lens[i]
        if end == start:
            continue
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)[None]
        if sliding_window is None:
            kk, vv = _gather_kv(k_cache, v_cache, block_table[i:i + 1], seq_lens[i:i + 1], ctx)
            k_pos = None
        else:  # the keys from the first query's window on
            first = max(0, ctx - (end - start) - sliding_window + 1)
            kk, vv, k_pos = _gather_window(k_cache, v_cache, block_table[i:i + 1], seq_lens.new_tensor([first]),
                                           seq_lens[i:i + 1] - 1, ctx - first)
        out[start:end] = _attend(q[None, start:end], kk, vv, q_pos, scale, sliding_window, softcap, k_pos)[0]
    return out


def verify_gather(block_table: Int[Tensor, "num_reqs_padded max_blocks"], seq_lens: Int[Tensor, "num_reqs_padded"],
                  q_len: int, block_size: int, max_seq_len: int, sliding_window: int | None
                  ) -> tuple[Int[Tensor, "num_reqs_padded ctx_len"], Int[Tensor, "num_reqs_padded ctx_len"] | None]:
    """The KV slots a uniform step's queries read, and their positions (None: 0..ctx_len-1):
    full attention every position up to max_seq_len, a sliding window only the W - 1 + q_len
    positions some query's window holds. The same for every layer of a KV pool in a step, so a
    model may compute it once and pass it to each layer (`kv_slots`, `kv_pos`)."""
    if sliding_window is None:
        return context_slots(block_table, seq_lens - 1, block_size, max_seq_len), None
    span = min(max_seq_len, sliding_window - 1 + q_len)
    k_pos = window_start(seq_lens - q_len, sliding_window)[:, None] + torch.arange(span, device=seq_lens.device)
    pos = torch.minimum(k_pos, (seq_lens - 1)[:, None])
    return block_table.gather(1, pos // block_size) * block_size + pos % block_size, k_pos


@checked
def paged_attention_verify(
    q: Float[Tensor, "num_reqs_padded q_len heads head_dim"],
    k_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
    v_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"],
    seq_lens: Int[Tensor, "num_reqs_padded"],
    block_table: Int[Tensor, "num_reqs_padded max_blocks"],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    kv_slots: Int[Tensor, "num_reqs_padded ctx_len"] | None = None,
    kv_pos: Int[Tensor, "num_reqs_padded ctx_len"] | None = None,
) -> Float[Tensor, "num_reqs_padded q_len heads head_dim"]:
    """A uniform verify/decode step, batched over requests: every request's bundle tokens
    are its last positions seq_lens[i] - bundle .. seq_lens[i] - 1. K/V are gathered up to
    max(seq_lens) (a sliding window: only the keys some query's window holds,
    `verify_gather`) and masked per row by seq_len, causality and the window. Padded rows
    (block-table row of zeros, seq_len = bundle) read the null block and stay finite.
    Requires seq_lens >= bundle, so every query sees at least itself. `max_seq_len` (an upper
    bound of seq_lens, known on the host) avoids a device sync; graphs pass the largest
    possible. `kv_slots` (computed once for several calls: `verify_gather`, or a drafter's
    `context_slots` clamped from below to the window like `_gather_kv`): K/V are gathered
    through it instead, the columns at positions `kv_pos` (None: 0..ctx_len-1, which must
    cover seq_lens)."""
    bundle = q.shape[1]
    if kv_slots is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
        kv_slots, kv_pos = verify_gather(block_table, seq_lens, bundle, k_cache.shape[1], max_seq_len, sliding_window)
    kk, vv = gather_slots(k_cache, v_cache, kv_slots)
    q_pos = seq_lens[:, None] - bundle + torch.arange(bundle, device=q.device)
    return _attend(q, kk, vv, q_pos, scale, sliding_window, softcap, kv_pos)
