"""Prefix caching (mtpkit/engine/prefix_cache.py): a request reuses the KV blocks (and, for
Qwen3-Next, a state snapshot) of the longest cached prefix of its tokens, and its output is
the uncached run's, token for token, with the first generated position's logprobs equal to
1e-9 (float64 embedded models).

Cases: hits at a block boundary, in the middle of a block, of a whole prompt (also with
chunked prefill), after eviction,
after preemption; num_spec 0..4 with the MTP head (whose KV keys hold the token after the
block), the Gemma 4 assistant (reads the target's KV) and a draft model (its own KV groups in
the same blocks); seeded sampling; n samples; a request whose last verify step partially
accepted its drafts, then one sharing its prefix and outputs; a hit where the state snapshot
is a block behind the KV, and the snapshot a request writes where it leaves the cached KV; a
sliding-window hit whose blocks below the window are gone; a
5-turn chat; reset_prefix_cache; the allocator's keys and LRU.
"""

import itertools

import pytest
import torch

from mtpkit import LLM, SamplingParams
from mtpkit.engine.allocators import BlockAllocator
from mtpkit.engine.pool_sizing import plan_pools
from mtpkit.engine.prefix_cache import BlockCache, extend_keys, root_key
from mtpkit.step.cache_spec import CacheSpec, KVGroup, StateGroup, StateTensor

BLOCK = 16
F64 = {"dtype": "float64", "device": "cpu", "max_model_len": 1024, "block_size": BLOCK}
FAMILIES = {"qwen3_next": ("tiny-qwen3-next", {}),
            "gemma4": ("tiny-gemma4", {"draft_model": "tiny-gemma4-assistant"}),
            "gemma4_draft_model": ("tiny-gemma4", {"draft_model": "tiny-gemma4"})}

_LLMS: dict = {}
# Engines kept at once (the least recently used closed first): each holds pools for 8 requests of
# 1024 float64 positions and its snapshots, and the file's ~12 configurations together took the
# worker past 2 GB.
MAX_KEPT = 4


def _llm(family: str, num_spec: int, cache: bool = True, **kw) -> LLM:
    if family == "qwen3_next" and cache:   # state snapshots at every block boundary a prefill reaches
        kw.setdefault("prefix_snapshot_interval", BLOCK)
    key = (family, num_spec, cache, tuple(sorted(kw.items())))
    if key in _LLMS:
        _LLMS[key] = _LLMS.pop(key)   # the most recently used last
    else:
        while len(_LLMS) >= MAX_KEPT:
            _LLMS.pop(next(iter(_LLMS))).close()
        name, extra = FAMILIES[family]
        _LLMS[key] = LLM(name, num_spec=num_spec, enable_prefix_caching=cache, **{**F64, **kw},
                         **(extra if num_spec else {}))
        if num_spec == 3 and _LLMS[key].runner.graphs is not None:
            _LLMS[key].runner.graphs.trace_after = 0   # the captured (traced) decode path, from the first step
    return _LLMS[key]


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(37 * j + 11 * salt) % 90 + 3 for j in range(length)]


GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4)


def _seeded(seed: int = 7) -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.95, seed=seed, logprobs=4)


_REFS: dict = {}


def _ref(family: str, prompt: list[int], params: SamplingParams):
    """The uncached run's output (num_spec 0: greedy and seeded tokens do not depend on it)."""
    key = (FAMILIES[family][0], tuple(prompt), params.temperature, params.seed)
    if key not in _REFS:
        _REFS[key] = _llm(family, 0, cache=False).generate([prompt], params)[0]
    return _REFS[key]


def _same(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    first, want = out.logprobs[0], ref.logprobs[0]
    assert first.keys() == want.keys()
    for t in want:   # the first generated position's distribution: the last prompt position's logits
        assert abs(first[t].logprob - want[t].logprob) < 1e-9


def _run(llm: LLM, family: str, prompts: list[list[int]], params=GREEDY, setup=lambda: None) -> list[int]:
    """Each prompt in turn, from an empty cache (after `setup`); checks each against the
    uncached run (and its drafts against the same LLM's with the cache emptied first: a wrong
    drafter KV block changes which drafts are accepted, not the tokens). Returns their
    num_cached_tokens."""
    cold = []
    for p in prompts:
        llm.reset_prefix_cache()
        cold.append(llm.generate([p], params)[0].token_draft_positions)
    llm.reset_prefix_cache()
    _poison(llm)
    setup()
    cached = []
    for p, drafts in zip(prompts, cold):
        out = llm.generate([p], params)[0]
        _same(out, _ref(family, p, params))
        assert out.token_draft_positions == drafts
        cached.append(out.num_cached_tokens)
    return cached


def _poison(llm: LLM) -> None:
    """NaN in every KV block (nothing is held or cached): a position read from the cache
    that no step of these runs wrote (the runs above leave stale but right values) shows."""
    assert not llm.scheduler.has_unfinished()
    for layers in llm.cache.kv.values():
        for k, v in layers:
            k.fill_(float("nan")), v.fill_(float("nan"))


BASE = _prompt(90)
BOUNDARY = BASE[:80] + _prompt(9, salt=1)          # diverges at a block boundary
MID = BASE[:85] + _prompt(6, salt=2)               # diverges inside block 5
WHOLE = BASE                                       # the same prompt again


@pytest.mark.parametrize("family,num_spec", [("qwen3_next", 0), ("qwen3_next", 1), ("qwen3_next", 2),
                                             ("qwen3_next", 3), ("qwen3_next", 4), ("gemma4", 3),
                                             ("gemma4_draft_model", 2)])
def test_hits_equal_uncached(family, num_spec):
    llm = _llm(family, num_spec)
    before = llm.stats.prefix_cache
    cached = _run(llm, family, [BASE, BOUNDARY, MID, WHOLE])
    # 80 = the last full block before BASE's last token (a whole-prompt hit leaves it to
    # compute). With the MTP head block 4's key holds token 80 (its MTP KV at 79 was computed
    # from it): BOUNDARY, which differs there, cannot use block 4.
    mtp = family == "qwen3_next" and num_spec > 0
    assert cached == [0, 64 if mtp else 80, 80, 80]
    stats = llm.stats.prefix_cache
    assert stats.hit_tokens - before.hit_tokens == sum(cached) and stats.cached_blocks > 0
    assert stats.queries - before.queries == 8    # the runs from an empty cache too


@pytest.mark.parametrize("family", ["qwen3_next", "gemma4"])
def test_hits_equal_uncached_with_chunked_prefill(family):
    """Prefill chunks of 24 tokens (not a multiple of the block): the hits, the keys and the
    snapshots written inside chunks are those of one-chunk prefills."""
    llm = _llm(family, 3, max_num_batched_tokens=24)
    cached = _run(llm, family, [BASE, BOUNDARY, MID, WHOLE])
    assert cached == [0, 64 if family == "qwen3_next" else 80, 80, 80]


def _prefilled_kv(llm: LLM, prompt: list[int]) -> dict:
    """Every KV group's K and V at each position of `prompt` a request holds once its prefill
    is done (the target's, the MTP head's, the draft model's; a sliding pool from its floor)."""
    req = llm.add_request(prompt, GREEDY)
    while req.in_prefill or not req.num_computed:
        llm.step()
    cache, bs, kv = llm.cache, BLOCK, {}
    for g, layers in cache.kv.items():
        t = req.block_tables[cache.pool_index[g]]
        pos = [p for p in range(t.floor * bs, len(prompt))]
        blocks = [t.ids[p // bs] for p in pos]
        kv[g] = [(k[blocks, [p % bs for p in pos]], v[blocks, [p % bs for p in pos]]) for k, v in layers]
    llm.abort([req.req_id])
    return kv


@pytest.mark.parametrize("family", ["qwen3_next", "gemma4_draft_model"])
def test_hit_kv_equals_computed(family):
    """What a hit request reads is what it would have computed: every group's KV (the MTP
    head's at the block's last position needs the token after it) after a prefill through a
    hit equals the KV after a prefill from an empty cache, to 1e-12 (float64)."""
    llm = _llm(family, 2)
    llm.reset_prefix_cache()
    cold = _prefilled_kv(llm, BOUNDARY)
    llm.reset_prefix_cache()
    llm.generate([BASE], GREEDY)
    llm.generate([BOUNDARY[:85] + [1]], GREEDY)    # blocks 0..4 of BOUNDARY cached
    hit = _prefilled_kv(llm, BOUNDARY)
    assert llm.stats.prefix_cache.hit_tokens > 0
    for g in cold:
        for (k0, v0), (k1, v1) in zip(cold[g], hit[g]):
            n = min(len(k0), len(k1))   # a sliding pool: the positions both still hold (the last ones)
            assert n >= len(BOUNDARY) - 64
            assert (k0[-n:] - k1[-n:]).abs().max() < 1e-12 and (v0[-n:] - v1[-n:]).abs().max() < 1e-12, g


@pytest.mark.parametrize("family", ["qwen3_next", "gemma4"])
def test_seeded_and_n_samples(family):
    llm = _llm(family, 3)
    llm.reset_prefix_cache()
    p = _prompt(70, salt=3)
    assert _run(llm, family, [p, p[:66] + [5, 6, 7]], _seeded()) == [0, 64]
    outs = llm.generate([p + [9, 9]], SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=11, ignore_eos=True))
    for i, o in enumerate(outs[0].outputs):
        ref = _ref(family, p + [9, 9], SamplingParams(max_tokens=8, temperature=0.9, seed=11 + i, ignore_eos=True))
        assert o.token_ids == ref.token_ids
    assert outs[0].num_cached_tokens == 64


def test_partially_accepted_then_shared():
    """A request's last verify step accepts part of its drafts (its last block holds rejected
    drafts' KV past the accepted end), or it ends right after its prefill (the sampled token's
    KV is never computed); a new request whose prompt is that request's prompt and output hits
    its accepted blocks only, and equals the uncached run."""
    for family in ("qwen3_next", "gemma4"):
        llm = _llm(family, 3)
        for length, max_tokens in ((40, 24), (47, 1)):   # each ends at a block's last position
            p, first = _prompt(length, salt=4), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            out = llm.generate([p], first)[0]
            if max_tokens > 1:
                assert out.spec_stats.num_accepted < out.spec_stats.num_drafted   # some drafts were rejected
            follow = p + out.token_ids + [7, 8]
            (cached,) = _run(llm, family, [follow], setup=lambda llm=llm, p=p, first=first: llm.generate([p], first))
            # its blocks below its last position (the generated ones too), not the last one
            assert cached == (length + max_tokens - 1) // BLOCK * BLOCK


def test_snapshot_block_behind_kv():
    """Qwen3-Next: the KV covers 80 tokens of the new prompt, the state snapshots sit at 32,
    64, 96: the hit resumes at 64."""
    llm = _llm("qwen3_next", 2, prefix_snapshot_interval=32)
    llm.reset_prefix_cache()
    p = _prompt(100, salt=5)
    assert _run(llm, "qwen3_next", [p, p[:90] + [4, 4, 4]]) == [0, 64]


def test_a_request_leaving_the_cached_kv_snapshots_there():
    """Qwen3-Next: a request whose prompt leaves the cached KV between two snapshot boundaries
    (80, snapshots at 64 and 96) writes a snapshot where it left (80), so the next request
    sharing that prefix resumes at 80, not 64."""
    llm = _llm("qwen3_next", 2, prefix_snapshot_interval=32)
    p = _prompt(100, salt=5)
    # tails of 20 and 15 tokens: their own last full blocks (96) are past where they leave p
    assert _run(llm, "qwen3_next", [p, p[:90] + _prompt(20, salt=6), p[:90] + _prompt(15, salt=7)]) == [0, 64, 80]


def test_sliding_window_hit_past_the_window():
    """Gemma 4 (window 64): a hit at 128 needs the sliding pool's blocks from
    (128 - 63 - read_back) // 16 = 3 on only; the ones below are dropped from the cache
    first (as recycling would reuse them), and the hit still covers 128 tokens."""
    llm = _llm("gemma4", 3)
    p = _prompt(140, salt=6)
    name = next(n for n in llm.kv_pools.allocators if n.startswith("sliding"))
    alloc = llm.kv_pools[name]

    def setup():
        llm.generate([p], GREEDY)
        for k in extend_keys_of(llm, p)[:3]:   # forget the three lowest sliding blocks
            b = alloc.cache.index[k]
            alloc.cache.lru.pop(b)
            del alloc.cache.index[alloc.cache.key_of.pop(b)]
            alloc._free.append(b)
    assert _run(llm, "gemma4", [p[:130] + [3, 3]], setup=setup) == [128]


def extend_keys_of(llm: LLM, tokens: list[int]) -> list[bytes]:
    pc, keys = llm.engine.prefix_cache, []
    extend_keys(keys, tokens, BLOCK, pc.lookahead, pc.root)
    return keys


@pytest.mark.parametrize("family", ["qwen3_next", "gemma4"])
def test_eviction_and_preemption(family):
    """A pool of 14 blocks: the second prompt evicts the first's cached blocks (the last ones
    first); two prompts at once preempt one, which re-prefills through the cache."""
    llm = _llm(family, 2, num_blocks=14, max_num_seqs=2, max_model_len=200, num_prefix_snapshots=32)
    llm.reset_prefix_cache()
    a, b = _prompt(120, salt=7), _prompt(120, salt=8)
    cached = _run(llm, family, [a, b, a[:100] + [3]])
    stats = llm.stats.prefix_cache
    assert stats.evictions > 0 and cached[2] < 96
    outs = llm.generate([a[:60] + [1], b[:70] + [2]], SamplingParams(max_tokens=60, ignore_eos=True))
    assert sum(o.num_preemptions for o in outs) > 0
    for o, p in zip(outs, [a[:60] + [1], b[:70] + [2]]):
        assert o.token_ids == _llm(family, 0, cache=False).generate(
            [p], SamplingParams(max_tokens=60, ignore_eos=True))[0].token_ids
    assert llm.stats.prefix_cache.hit_tokens > stats.hit_tokens    # the recomputation hit


@pytest.mark.parametrize("family", ["qwen3_next", "gemma4"])
def test_five_turn_chat(family):
    llm, plain = _llm(family, 3), _llm(family, 0, cache=False)
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    msgs, cached = [], []
    for turn in range(5):
        msgs.append({"role": "user", "content": f"turn {turn}: tell me about the number {turn * 7 + 3}"})
        out, ref = llm.chat(msgs, params)[0], plain.chat(msgs, params)[0]
        assert out.token_ids == ref.token_ids
        cached.append(out.num_cached_tokens)
        msgs.append({"role": "assistant", "content": out.text})
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached)), cached


def test_reset_refused_while_running():
    llm = _llm("gemma4", 3)
    llm.generate([BASE], GREEDY)
    req = llm.add_request(BASE, GREEDY)
    assert llm.reset_prefix_cache() is False
    while llm.scheduler.has_unfinished():
        llm.step()
    assert req.num_cached_tokens == 80
    assert llm.reset_prefix_cache() is True
    assert llm.stats.prefix_cache.cached_blocks == 0
    assert llm.generate([BASE], GREEDY)[0].num_cached_tokens == 0
    # prompt logprobs are computed, not taken from the cache: every position's is there
    want = _llm("gemma4", 0, cache=False).generate([BASE], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    out = llm.generate([BASE], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(BASE) == len(want.prompt_logprobs)
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-9
               for a, b in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:]) for t in b)


def test_snapshot_pool_in_memory_plan():
    """The snapshots are part of the budget (a state slot's bytes each) and of the printed plan."""
    spec = CacheSpec(kv=(KVGroup("a", 2, 2, 8),), state=(StateGroup("s", 3, {"ssm": StateTensor((4, 8, 8))}),))
    kw = {"budget": 1 << 22, "weight_bytes": 1 << 20, "activation_bytes": 1 << 20, "activation_source": "estimated",
          "spec": spec, "block_size": 16, "dtype": torch.float32, "max_blocks": 8, "bundle": 2, "max_num_seqs": 2,
          "max_model_len": 128, "source": "memory_budget"}
    with_snaps, without = plan_pools(**kw, snapshots=10), plan_pools(**kw)
    per_slot = spec.bytes_per_slot(torch.float32)
    assert with_snaps.num_snapshots == 10 and "10 prefix-cache state snapshots" in with_snaps.summary()
    assert (without.num_blocks - with_snaps.num_blocks) * without.bytes_per_block >= 10 * per_slot - without.bytes_per_block
    llm = _llm("qwen3_next", 2)
    assert next(iter(llm.cache.snapshots.values()))[0]["ssm"].shape[0] == 4 * 8   # 4 per max_num_seqs request


def test_block_keys_and_lru():
    root = root_key("model|drafter|float64")
    toks = list(range(40))
    k1, k2, k3 = [], [], []
    extend_keys(k1, toks, 16, False, root)
    extend_keys(k2, toks[:32], 16, True, root)          # block 1 needs token 32 too: not keyed yet
    extend_keys(k3, toks, 16, False, root_key("other"))
    assert len(k1) == 2 and len(k2) == 1 and k1[0] == extend_keys_same(toks, root)
    assert k2[0] != k1[0] and k3[0] != k1[0]
    nxt = toks[:16] + [99]
    k4 = []
    extend_keys(k4, nxt, 16, True, root)
    assert k4[0] != k2[0]                                # the token after the block is in the key

    cache = BlockCache()
    alloc = BlockAllocator(6, cache)
    a = alloc.allocate(3)                                # plain blocks 1, 2, 3
    assert a == [1, 2, 3]
    for b, key in zip(a, [b"x", b"y", b"z"]):
        assert cache.register(b, key)
    assert not cache.register(4, b"x")                   # a key names one block
    alloc.free(a)
    assert alloc.num_free == 5 and list(cache.lru) == [3, 2, 1]   # the tail first to go
    alloc.share([cache.lookup(b"x")])                    # a hit revives block 1
    assert alloc.refcount(1) == 1 and 1 not in cache.lru
    got = alloc.allocate(3)                              # plain 4, 5, then the oldest cached: 3
    assert got == [4, 5, 3] and cache.lookup(b"z") is None and cache.evictions == 1
    assert alloc.allocate(2) is None and alloc.allocate(1) == [2]


def test_block_keys_from_a_tail_are_the_whole_sequences():
    """extend_keys reading the sequence from the first block not keyed yet (what a step passes:
    its host work must not grow with the sequence) gives the keys the whole sequence gives, with
    and without the lookahead token; a tail that leaves out an unkeyed block is refused."""
    root = root_key("m")
    g = torch.Generator().manual_seed(0)
    for lookahead in (False, True):
        toks = torch.randint(0, 257, (200,), generator=g).tolist()
        whole = []
        extend_keys(whole, toks, 16, lookahead, root)
        keys, end = [], 0
        for step in (5, 17, 1, 40, 3, 64, 70):   # steps of any size, as a request's grow
            end = min(end + step, len(toks))
            start = len(keys) * 16
            extend_keys(keys, toks[start:end], 16, lookahead, root, offset=start)
        assert len(whole) == 12 and keys == whole
    with pytest.raises(ValueError, match="leave out block 0"):
        extend_keys([], toks[16:], 16, False, root, offset=16)


def test_verify_steps_do_not_build_the_whole_sequence(monkeypatch):
    """A verify step reads a request's last token and, with the prefix cache, only the tokens of
    the blocks not keyed yet (Request.last_token_id, Request.tokens_from): Request.all_token_ids,
    a copy of the whole sequence, is never built inside one (it made a step's host work grow
    with the sequence); the prefill steps may use it."""
    from mtpkit.engine.request import Request
    from mtpkit.engine.runner import ModelRunner
    from mtpkit.engine.scheduler import Scheduler, StepKind
    calls, in_verify = [], [False]
    whole = Request.all_token_ids.fget
    monkeypatch.setattr(Request, "all_token_ids", property(lambda r: calls.append(in_verify[0]) or whole(r)))

    def during_verify(method, is_verify):
        def run(self, plan, *args):
            in_verify[0] = is_verify(plan)
            try:
                return method(self, plan, *args)
            finally:
                in_verify[0] = False
        return run
    monkeypatch.setattr(ModelRunner, "_verify", during_verify(ModelRunner._verify, lambda plan: True))
    monkeypatch.setattr(Scheduler, "update", during_verify(Scheduler.update, lambda plan: plan.kind == StepKind.VERIFY))
    for cache in (True, False):
        calls.clear()
        llm = LLM("tiny-qwen3-next", num_spec=2, enable_prefix_caching=cache, block_size=BLOCK)
        out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=48, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 48
        assert calls and not any(calls), f"prefix cache {cache}: {sum(calls)} whole-sequence copies in verify steps"


def extend_keys_same(toks, root):
    keys = []
    extend_keys(keys, toks, 16, False, root)
    return keys[0]
