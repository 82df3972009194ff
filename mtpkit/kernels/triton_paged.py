"""Triton kernels of paged full attention (causal, GQA, head_dim up to 512, sliding window,
logit softcap), beside their torch references in paged.py (same signatures and semantics;
tested against them under TRITON_INTERPRET=1). `write_kv` stays the torch reference (one
index_put per layer, capturable).

Verify / decode (`paged_attention_verify`), split-KV ("flash decoding"), one or two launches:
- grid (num_reqs_padded, kv_heads, num_splits). A program stacks the G = heads / kv_heads
  query heads of its KV head and the request's bundle tokens into one [G*bundle (padded to
  >= 16), head_dim (padded to a power of 2, masked)] query tile, so K/V are read once per KV
  head. It walks its split of the context in BLOCK_N-token steps, gathering each position
  through the block table, with an online softmax (fp32). The mask is causal inside the
  bundle (query t of a request sits at position seq_len - bundle + t), cuts at seq_len and
  optionally at the sliding window (keys > pos - window; whole blocks below the window are
  skipped). softcap * tanh(s / softcap) is applied before masking.
- num_splits > 1: every split writes its unnormalised output, running max and sum to an
  fp32 scratch buffer and a second kernel merges them (log-sum-exp). num_splits depends
  only on shapes (num_reqs_padded, kv_heads, block-table width), so each shape compiles
  once; the split length on those and the host-side bound max_seq_len (else the
  block-table width). Never on seq_lens values: no host sync, and the launch is the same on
  every replay of a captured graph. Splits past a row's seq_len contribute nothing.

Varlen prefill over a cached prefix (`paged_attention_prefill`): grid
(num_reqs, heads, cdiv(max_query_len, BLOCK_M)); request i's queries are tokens
[qsl[i], qsl[i+1]) at positions seq_lens[i] - q_len ..; keys run from the window start (or 0)
to the block's last query position, gathered through the block table. Prefill runs eager:
its one host sync (the longest query) is allowed.

flash-attn, when importable on CUDA and applicable (fp16/bf16, head_dim <= 256, block size a
multiple of 256 as its paged KV needs, MTPKIT_FLASH_ATTN not 0), replaces both kernels via
flash_attn_with_kvcache / flash_attn_varlen_func. It cannot be installed on the machines
this was written on, so that path is untested here.

Scores, softmax and accumulation in fp32 (16-bit inputs use the tensor cores with fp32
accumulation, probabilities cast to the value dtype for the second product as flash
attention does; fp32 inputs use IEEE fp32 products).
triton_common.use_reference's rule (fp64) sends a call to the torch reference.
Fixed launch configurations, no autotuning.
"""

import os

import torch
import triton
import triton.language as tl

from mtpkit.shapes import Float, Int, Tensor, checked

from mtpkit.kernels import paged as ref
from mtpkit.kernels.triton_common import interpreting, use_reference

__all__ = ["write_kv", "paged_attention_prefill", "paged_attention_verify", "num_splits"]

write_kv = ref.write_kv

MAX_HEAD_DIM = 512


# ---------------------------------------------------------------------------------------
# configuration (shape-only, fixed)

# Tests set this to force a split count; None = the heuristic below.
SPLITS_OVERRIDE: int | None = None
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def num_splits(num_reqs: int, kv_heads: int, max_ctx: int, device: torch.device) -> int:
    """KV splits for a verify launch: enough programs to fill the GPU twice over, each split
    at least MIN_SPLIT_TOKENS long. Shapes only (graph-safe)."""
    if SPLITS_OVERRIDE is not None:
        return max(1, int(SPLITS_OVERRIDE))
    programs = max(num_reqs * kv_heads, 1)
    want = triton.cdiv(2 * _sm_count(device), programs)
    return max(1, min(want, triton.cdiv(max_ctx, MIN_SPLIT_TOKENS), MAX_SPLITS))


def _tiles(head_dim: int) -> tuple[int, int, int]:
    """(BD, BLOCK_N, num_warps) for a head dim."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported by the Triton kernels")
    BD = max(triton.next_power_of_2(head_dim), 16)
    if BD <= 128:
        return BD, 64, 4
    if BD <= 256:
        return BD, 32, 8
    return BD, 16, 8


# ---------------------------------------------------------------------------------------
# kernels


@triton.jit
def _softcapped(s, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    return s


@triton.jit
def _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row_ptr, sbt_b, kvh,
                  sk_b, sk_o, sk_h, sk_d, sv_b, sv_o, sv_h, sv_d,
                  kpos, kmask, offd, md, q_pos, scale, softcap, window,
                  PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  DOT16: tl.constexpr, NATIVE: tl.constexpr):
    """One BLOCK_N step of the online softmax for a [BM, BD] query tile at q_pos [BM]."""
    blk = tl.load(bt_row_ptr + (kpos // PAGE) * sbt_b, mask=kmask, other=0).to(tl.int64)
    off = (kpos % PAGE).to(tl.int64)
    kvm = kmask[:, None] & md[None, :]
    k = tl.load(k_ptr + blk[:, None] * sk_b + off[:, None] * sk_o + kvh * sk_h + offd[None, :] * sk_d,
                mask=kvm, other=0.0)
    v = tl.load(v_ptr + blk[:, None] * sv_b + off[:, None] * sv_o + kvh * sv_h + offd[None, :] * sv_d,
                mask=kvm, other=0.0)
    if NATIVE:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = _softcapped(s * scale, softcap, HAS_SOFTCAP)
    visible = kmask[None, :] & (kpos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (kpos[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if NATIVE:
        pv = tl.dot(p.to(v.dtype), v)
    elif DOT16:
        # the same rounding of p as the native path, products in fp32
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _paged_verify_kernel(
    q_ptr, k_ptr, v_ptr, seq_ptr, bt_ptr, o_ptr, part_ptr, ml_ptr,
    sq_r, sq_t, sq_h, sq_d,
    sk_b, sk_o, sk_h, sk_d,
    sv_b, sv_o, sv_h, sv_d,
    sbt_r, sbt_b,
    so_r, so_t, so_h, so_d,
    scale, softcap, window, split_len,
    B: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT16: tl.constexpr,
    NATIVE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    rows = tl.arange(0, BM)
    mrow = rows < G * B
    g = rows // B
    t = rows % B
    head = kvh * G + g
    offd = tl.arange(0, BD)
    md = offd < D
    seq_len = tl.load(seq_ptr + r).to(tl.int64)
    q_pos = seq_len - B + t
    qm = mrow[:, None] & md[None, :]
    q = tl.load(q_ptr + r * sq_r + t[:, None] * sq_t + head[:, None] * sq_h + offd[None, :] * sq_d,
                mask=qm, other=0.0)
    if not NATIVE:
        q = q.to(tl.float32)
    lo = (split * split_len).to(tl.int64)
    hi = tl.minimum(lo + split_len, seq_len)
    if HAS_WINDOW:
        # the earliest query (position seq_len - B) sees keys > seq_len - B - window
        lo = tl.maximum(lo, seq_len - B - window + 1)
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for start in range(lo, hi, BN):
        kpos = start + tl.arange(0, BN)
        kmask = kpos < hi
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr + r * sbt_r, sbt_b, kvh,
                                      sk_b, sk_o, sk_h, sk_d, sv_b, sv_o, sv_h, sv_d,
                                      kpos, kmask, offd, md, q_pos, scale, softcap, window,
                                      PAGE, HAS_WINDOW, HAS_SOFTCAP, DOT16, NATIVE)
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + r * so_r + t[:, None] * so_t + head[:, None] * so_h + offd[None, :] * so_d,
                 o.to(o_ptr.dtype.element_ty), mask=qm)
    else:
        base = (r * tl.num_programs(1) + kvh) * SPLITS + split
        tl.store(part_ptr + (base * BM + rows[:, None]) * BD + offd[None, :], acc)
        tl.store(ml_ptr + (base * BM + rows) * 2, m_i)
        tl.store(ml_ptr + (base * BM + rows) * 2 + 1, l_i)


@triton.jit
def _merge_splits_kernel(
    part_ptr, ml_ptr, o_ptr,
    so_r, so_t, so_h, so_d,
    B: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BM)
    offd = tl.arange(0, BD)
    base0 = (r * tl.num_programs(1) + kvh) * SPLITS
    m = tl.full([BM], -1e30, tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(ml_ptr + ((base0 + s) * BM + rows) * 2))
    acc = tl.zeros([BM, BD], tl.float32)
    l = tl.zeros([BM], tl.float32)
    for s in range(SPLITS):
        w = tl.exp(tl.load(ml_ptr + ((base0 + s) * BM + rows) * 2) - m)
        l += w * tl.load(ml_ptr + ((base0 + s) * BM + rows) * 2 + 1)
        acc += w[:, None] * tl.load(part_ptr + ((base0 + s) * BM + rows[:, None]) * BD + offd[None, :])
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    g = rows // B
    t = rows % B
    head = kvh * G + g
    qm = (rows < G * B)[:, None] & (offd < D)[None, :]
    tl.store(o_ptr + r * so_r + t[:, None] * so_t + head[:, None] * so_h + offd[None, :] * so_d,
             o.to(o_ptr.dtype.element_ty), mask=qm)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, qsl_ptr, seq_ptr, bt_ptr, o_ptr,
    sq_t, sq_h, sq_d,
    sk_b, sk_o, sk_h, sk_d,
    sv_b, sv_o, sv_h, sv_d,
    sbt_r, sbt_b,
    so_t, so_h, so_d,
    scale, softcap, window,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT16: tl.constexpr,
    NATIVE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    mb = tl.program_id(2)
    kvh = head // G
    start = tl.load(qsl_ptr + i).to(tl.int64)
    q_len = tl.load(qsl_ptr + i + 1).to(tl.int64) - start
    if mb * BM < q_len:
        seq_len = tl.load(seq_ptr + i).to(tl.int64)
        rows = mb * BM + tl.arange(0, BM)
        mrow = rows < q_len
        q_pos = seq_len - q_len + rows
        offd = tl.arange(0, BD)
        md = offd < D
        qm = mrow[:, None] & md[None, :]
        tok = start + rows
        q = tl.load(q_ptr + tok[:, None] * sq_t + head * sq_h + offd[None, :] * sq_d, mask=qm, other=0.0)
        if not NATIVE:
            q = q.to(tl.float32)
        hi = tl.minimum(seq_len - q_len + mb * BM + BM, seq_len)  # past the block's last query
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(seq_len - q_len + mb * BM - window + 1, 0)
        m_i = tl.full([BM], -1e30, tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BD], tl.float32)
        for kstart in range(lo, hi, BN):
            kpos = kstart + tl.arange(0, BN)
            kmask = kpos < hi
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr + i * sbt_r, sbt_b, kvh,
                                          sk_b, sk_o, sk_h, sk_d, sv_b, sv_o, sv_h, sv_d,
                                          kpos, kmask, offd, md, q_pos, scale, softcap, window,
                                          PAGE, HAS_WINDOW, HAS_SOFTCAP, DOT16, NATIVE)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + tok[:, None] * so_t + head * so_h + offd[None, :] * so_d,
                 o.to(o_ptr.dtype.element_ty), mask=qm)


# ---------------------------------------------------------------------------------------
# flash-attn (optional)

_FLASH = None


def _flash_module():
    global _FLASH
    if _FLASH is None:
        _FLASH = False
        if os.environ.get("MTPKIT_FLASH_ATTN", "1").strip().lower() not in ("0", "false", "no"):
            try:
                import flash_attn  # noqa: F401
                _FLASH = flash_attn
            except Exception:
                pass
    return _FLASH or None


def _flash_applicable(q: Float[Tensor, "... heads head_dim"],  # prefill [T, H, D] or verify [R, B, H, D]
                      k_cache: Float[Tensor, "num_blocks block_size kv_heads head_dim"]) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and k_cache.shape[1] % 256 == 0
            and _flash_module() is not None)


def _flash_window(sliding_window):
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def _dot_mode(*xs: Tensor) -> dict:
    """DOT16: every operand has the same 16-bit type (p is then rounded to it, as flash
    attention does). NATIVE: 16-bit tensor-core products; otherwise fp32 IEEE products. The
    interpreter's 16-bit tl.dot is wrong (triton 3.9), so it always takes the fp32 route,
    which gives the same values since products of 16-bit floats are exact in fp32."""
    dtypes = {x.dtype for x in xs}
    dot16 = len(dtypes) == 1 and next(iter(dtypes)) in (torch.float16, torch.bfloat16)
    return dict(DOT16=dot16, NATIVE=dot16 and not interpreting())


# ---------------------------------------------------------------------------------------
# entry points


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
    """Triton version of paged.paged_attention_verify (see the module docstring); no host
    sync. The launch depends on the tensor shapes and `max_seq_len` (a host-side upper bound
    of seq_lens; default: the block table's capacity), so a graph that passes a fixed
    max_seq_len replays the same launch. `kv_slots` / `kv_pos` are the torch path's
    precomputed gather: the kernel reads through the block table, masked at seq_lens and the
    window, and ignores them."""
    if use_reference(__name__, q, k_cache, v_cache):
        return ref.paged_attention_verify(q, k_cache, v_cache, seq_lens, block_table, scale,
                                          sliding_window, softcap, max_seq_len, kv_slots, kv_pos)
    R, B, H, D = q.shape
    page, KVH = k_cache.shape[1], k_cache.shape[2]
    if H % KVH:
        raise ValueError(f"heads ({H}) must be a multiple of kv_heads ({KVH})")
    if _flash_applicable(q, k_cache):
        from flash_attn import flash_attn_with_kvcache
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seq_lens.to(torch.int32),
            block_table=block_table.to(torch.int32), softmax_scale=scale, causal=True,
            window_size=_flash_window(sliding_window), softcap=0.0 if softcap is None else softcap)
    out = torch.empty_like(q)
    if R == 0:
        return out
    G = H // KVH
    BD, BN, warps = _tiles(D)
    BM = max(triton.next_power_of_2(G * B), 16)
    capacity = block_table.shape[1] * page
    # The split count follows the block-table width only (one compiled variant per shape);
    # the host-side bound max_seq_len, when given, only shortens the splits.
    splits = num_splits(R, KVH, capacity, q.device)
    max_ctx = capacity if max_seq_len is None else max(min(capacity, int(max_seq_len)), 1)
    split_len = triton.cdiv(triton.cdiv(max_ctx, splits), BN) * BN
    if splits > 1:
        part = torch.empty(R, KVH, splits, BM, BD, dtype=torch.float32, device=q.device)
        ml = torch.empty(R, KVH, splits, BM, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    _paged_verify_kernel[(R, KVH, splits)](
        q, k_cache, v_cache, seq_lens, block_table, out, part, ml,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *out.stride(),
        float(scale), 1.0 if softcap is None else float(softcap),
        0 if sliding_window is None else int(sliding_window), split_len,
        B=B, G=G, D=D, BD=BD, BM=BM, BN=BN, PAGE=page, SPLITS=splits,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        **_dot_mode(q, k_cache, v_cache), num_warps=warps,
    )
    if splits > 1:
        _merge_splits_kernel[(R, KVH)](
            part, ml, out, *out.stride(), B=B, G=G, D=D, BD=BD, BM=BM, SPLITS=splits, num_warps=warps)
    return out


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
    """Triton version of paged.paged_attention_prefill (see the module docstring)."""
    if use_reference(__name__, q, k_cache, v_cache):
        return ref.paged_attention_prefill(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                           scale, sliding_window, softcap)
    T, H, D = q.shape
    page, KVH = k_cache.shape[1], k_cache.shape[2]
    R = seq_lens.shape[0]
    if H % KVH:
        raise ValueError(f"heads ({H}) must be a multiple of kv_heads ({KVH})")
    if R == 0 or T == 0:
        return torch.empty_like(q)
    max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # the one host sync
    if _flash_applicable(q, k_cache):
        from flash_attn import flash_attn_varlen_func
        cu_k = torch.zeros(R + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = seq_lens.cumsum(0)
        return flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=query_start_loc.to(torch.int32), cu_seqlens_k=cu_k,
            max_seqlen_q=max_q, max_seqlen_k=int(seq_lens.max()), softmax_scale=scale, causal=True,
            window_size=_flash_window(sliding_window), softcap=0.0 if softcap is None else softcap,
            block_table=block_table.to(torch.int32))
    out = torch.empty_like(q)
    BD, BN, warps = _tiles(D)
    BM = 16 if BD > 128 or T <= 16 else 32 if T <= 32 or interpreting() else 64
    _paged_prefill_kernel[(R, H, triton.cdiv(max_q, BM))](
        q, k_cache, v_cache, query_start_loc, seq_lens, block_table, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *out.stride(),
        float(scale), 1.0 if softcap is None else float(softcap),
        0 if sliding_window is None else int(sliding_window),
        G=H // KVH, D=D, BD=BD, BM=BM, BN=BN, PAGE=page,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        **_dot_mode(q, k_cache, v_cache), num_warps=warps,
    )
    return out
