"""The pure-torch paged attention references against dense attention over each request's
whole sequence: cached prefix + new chunk, GQA, shuffled block tables, verify == prefill,
sliding window, softcap, padded rows."""

import pytest
import torch
import torch.nn.functional as F

from mtpkit import shapes
from mtpkit.kernels.paged import paged_attention_prefill, paged_attention_verify, write_kv

BS, D = 4, 8
TOL = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.float64: dict(atol=1e-13, rtol=1e-13),
       torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}


def dense_ref(q, k, v, scale, window=None, softcap=None):
    """Plain fp64 attention: q [Q, H, D] are the LAST Q positions of k, v [N, KVH, D]."""
    Q, N, H, KVH = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    k, v = (x.double().repeat_interleave(H // KVH, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp, kp = torch.arange(N - Q, N)[:, None], torch.arange(N)[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= kp > qp - window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)


class Pool:
    """A KV pool with shuffled, non-contiguous block tables and dense copies of each sequence."""

    def __init__(self, seq_lens, kv_heads=2, dtype=torch.float32, num_blocks=40, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.kv_heads = dtype, kv_heads
        self.k_cache = torch.zeros(num_blocks, BS, kv_heads, D, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.max_blocks = max(-(-n // BS) for n in seq_lens) + 1
        free = (torch.randperm(num_blocks - 1, generator=self.gen) + 1).tolist()
        self.tables = torch.zeros(len(seq_lens), self.max_blocks, dtype=torch.int32)
        for i, n in enumerate(seq_lens):
            for j in range(-(-n // BS)):
                self.tables[i, j] = free.pop()
        self.k = [self.randn(n, kv_heads, D) for n in seq_lens]
        self.v = [self.randn(n, kv_heads, D) for n in seq_lens]

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64).to(self.dtype)

    def write(self, i, start, end):
        pos = torch.arange(start, end)
        slots = self.tables[i, pos // BS].long() * BS + pos % BS
        write_kv(self.k[i][start:end], self.v[i][start:end], self.k_cache, self.v_cache, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (6, 1)])
def test_prefill_with_cached_prefix_equals_dense(dtype, heads, kv_heads):
    prefix, new = [0, 5, 8, 3], [6, 3, 1, 9]
    seq_lens = [p + n for p, n in zip(prefix, new)]
    pool = Pool(seq_lens, kv_heads, dtype)
    for i, (p, n) in enumerate(zip(prefix, new)):
        pool.write(i, 0, p)  # an earlier step cached the prefix
        pool.write(i, p, p + n)  # this step's own KV is written before attention
    q = pool.randn(sum(new), heads, D)
    qsl = torch.tensor([0] + new).cumsum(0)
    out = paged_attention_prefill(q, pool.k_cache, pool.v_cache, qsl, torch.tensor(seq_lens),
                                  pool.tables, scale=D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    for i in range(len(new)):
        ref = dense_ref(q[qsl[i]:qsl[i + 1]], pool.k[i], pool.v[i], D ** -0.5)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), ref, **TOL[dtype])


def test_prefill_matches_sdpa():
    # One more independent reference: torch's SDPA on a single full sequence with GQA.
    pool = Pool([13], kv_heads=2, seed=1)
    pool.write(0, 0, 13)
    q = pool.randn(13, 4, D)
    out = paged_attention_prefill(q, pool.k_cache, pool.v_cache, torch.tensor([0, 13]),
                                  torch.tensor([13]), pool.tables, scale=0.3)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), pool.k[0].transpose(0, 1),
                                         pool.v[0].transpose(0, 1), is_causal=True, scale=0.3,
                                         enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("window,softcap", [(3, None), (None, 2.0), (5, 1.5), (1, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sliding_window_and_softcap(window, softcap, dtype):
    prefix, new = [7, 0], [4, 6]
    seq_lens = [p + n for p, n in zip(prefix, new)]
    pool = Pool(seq_lens, 2, dtype, seed=2)
    for i, n in enumerate(seq_lens):
        pool.write(i, 0, n)
    # Scaled-up queries so the softcap actually bites.
    q = pool.randn(sum(new), 4, D) * 3
    qsl = torch.tensor([0] + new).cumsum(0)
    out = paged_attention_prefill(q, pool.k_cache, pool.v_cache, qsl, torch.tensor(seq_lens),
                                  pool.tables, scale=D ** -0.5, sliding_window=window, softcap=softcap)
    for i in range(2):
        ref = dense_ref(q[qsl[i]:qsl[i + 1]], pool.k[i], pool.v[i], D ** -0.5, window, softcap)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), ref, **TOL[dtype])
    if window is not None or softcap is not None:  # the options change the result
        plain = paged_attention_prefill(q, pool.k_cache, pool.v_cache, qsl, torch.tensor(seq_lens),
                                        pool.tables, scale=D ** -0.5)
        assert not torch.allclose(plain, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bundle", [1, 3])
@pytest.mark.parametrize("window,softcap", [(None, None), (4, 5.0)])
def test_verify_equals_prefill_and_padded_rows_are_finite(dtype, bundle, window, softcap):
    seq_lens = [bundle + 2, bundle + 9, bundle]
    pool = Pool(seq_lens, 2, dtype, seed=3)
    for i, n in enumerate(seq_lens):
        pool.write(i, 0, n)
    q = pool.randn(3, bundle, 4, D)
    kw = dict(scale=D ** -0.5, sliding_window=window, softcap=softcap)
    # Row 3 is a padded row: block-table row of zeros (the null block), seq_len = bundle.
    tables = torch.cat([pool.tables, torch.zeros(1, pool.max_blocks, dtype=torch.int32)])
    lens = torch.tensor(seq_lens + [bundle])
    pool.k_cache[0], pool.v_cache[0] = pool.randn(BS, 2, D), pool.randn(BS, 2, D)  # junk in null block
    q_pad = torch.cat([q, pool.randn(1, bundle, 4, D)])
    out = paged_attention_verify(q_pad, pool.k_cache, pool.v_cache, lens, tables, **kw)
    assert out.dtype == dtype and out.shape == q_pad.shape
    ref = paged_attention_prefill(q.flatten(0, 1), pool.k_cache, pool.v_cache,
                                  torch.arange(4) * bundle, torch.tensor(seq_lens), pool.tables, **kw)
    torch.testing.assert_close(out[:3].flatten(0, 1), ref, **TOL[dtype])
    assert torch.isfinite(out[3]).all()
    for i in range(3):
        dense = dense_ref(q[i], pool.k[i], pool.v[i], D ** -0.5, window, softcap)
        torch.testing.assert_close(out[i].double(), dense, **TOL[dtype])


def test_write_kv_slot_mapping():
    pool = Pool([6], kv_heads=1)
    pool.write(0, 0, 6)
    for p in range(6):
        blk = int(pool.tables[0, p // BS])
        torch.testing.assert_close(pool.k_cache[blk, p % BS], pool.k[0][p], atol=0, rtol=0)
        torch.testing.assert_close(pool.v_cache[blk, p % BS], pool.v[0][p], atol=0, rtol=0)
    used = set(pool.tables[0, :2].tolist())
    for blk in range(pool.k_cache.shape[0]):
        if blk not in used:
            assert not pool.k_cache[blk].any() and not pool.v_cache[blk].any()


def test_debug_mode_checks_shapes():
    pool = Pool([5, 3])
    pool.write(0, 0, 5)
    pool.write(1, 0, 3)
    kc, vc = pool.k_cache, pool.v_cache
    q = torch.randn(4, 4, D)
    with shapes.debug() as trace:
        paged_attention_prefill(q, kc, vc, torch.tensor([0, 2, 4]), torch.tensor([5, 3]), pool.tables,
                                scale=0.5)
        paged_attention_verify(q.view(2, 2, 4, D), kc, vc, torch.tensor([5, 3]), pool.tables, scale=0.5,
                               sliding_window=2, softcap=3.0)
        write_kv(torch.randn(2, 2, D), torch.randn(2, 2, D), kc, vc, torch.tensor([4, 5]))
        assert trace.entries[0].dims["kv_heads"] == 2 and trace.entries[1].dims["q_len"] == 2
        with pytest.raises(shapes.ShapeError):  # head_dim of q disagrees with the cache
            paged_attention_prefill(torch.randn(4, 4, D + 1), kc, vc, torch.tensor([0, 2, 4]),
                                    torch.tensor([5, 3]), pool.tables, scale=0.5)
        with pytest.raises(shapes.ShapeError):  # block table rows != num_reqs_padded
            paged_attention_verify(q.view(2, 2, 4, D), kc, vc, torch.tensor([5, 3]), pool.tables[:1],
                                   scale=0.5)
        with pytest.raises(shapes.ShapeError):  # v with a different kv_heads than k
            write_kv(torch.randn(2, 2, D), torch.randn(2, 1, D), kc, vc, torch.tensor([4, 5]))


def test_context_slots_clamp_to_the_positions_read():
    """Positions past last_pos read last_pos's slot; with first_pos (a sliding read) those
    before it read first_pos's, so blocks below a window are never touched."""
    from mtpkit.kernels.paged import context_slots
    table = torch.tensor([[5, 7, 2, 9], [3, 0, 0, 0]])
    last, first = torch.tensor([9, 2]), torch.tensor([6, 0])
    plain = context_slots(table, last, 4, 12)
    assert plain[0].tolist() == [20, 21, 22, 23, 28, 29, 30, 31, 8, 9, 9, 9]
    assert plain[1].tolist() == [12, 13, 14] + [14] * 9
    clamped = context_slots(table, last, 4, 12, first_pos=first)
    assert clamped[0].tolist() == [30] * 7 + [31, 8, 9, 9, 9]
    assert torch.equal(clamped[1], plain[1])
