"""SamplingParams.n: n samples of one prompt, the prompt prefilled once and its KV blocks shared
(reference-counted, copy-on-write), each sample starting from a copy of its recurrent state.

The check is the project's: sample i of a request with seed s gives, token for token, the
tokens of a separate n=1 request with seed s + i (position-keyed noise), with and without
drafts, both families (float64, so the prompt's chunk boundary at its last token cannot move
a draw), through preemption and the abort of one sample; the pools are whole afterwards.
"""

import json
import shutil

import pytest

from mtpkit import LLM, InputError, SamplingParams
from mtpkit.engine.request import SpecStats
from mtpkit.engine.scheduler import StepKind

F64 = {"dtype": "float64", "device": "cpu", "max_model_len": 96}
BLOCK = 16
SEED = 1234
N = 3
# The last prompt token's position L - 1 starts a block (nothing to copy) or lies inside the
# prompt's last, partly filled and shared, block (copied at the first write).
ALIGNED, UNALIGNED = 2 * BLOCK + 1, 2 * BLOCK - 5
FAMILIES = {"qwen3_next": ("tiny-qwen3-next", {}),
            "gemma4": ("tiny-gemma4", {"draft_model": "tiny-gemma4-assistant"})}


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(37 * j + 11 * salt) % 90 + 3 for j in range(length)]


def _sp(seed: int, n: int = 1, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.9, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True)


_LLMS: dict = {}


def _llm(family: str, num_spec: int, **kw) -> LLM:
    """One LLM per (family, num_spec, settings), reused by every test of the module."""
    key = (family, num_spec, tuple(sorted(kw.items())))
    if key not in _LLMS:
        name, extra = FAMILIES[family]
        _LLMS[key] = LLM(name, num_spec=num_spec, block_size=BLOCK, **F64,
                         **(extra if num_spec else {}), **kw)
    return _LLMS[key]


_REFS: dict = {}


def _refs(family: str, prompt: list[int], seed: int = SEED, n: int = N, max_tokens: int = 12) -> list[list[int]]:
    """Sample i's expected tokens: an n=1 request of seed + i, without drafts (one batch)."""
    key = (family, tuple(prompt), seed, n, max_tokens)
    if key not in _REFS:
        outs = _llm(family, 0).generate([prompt] * n, [_sp(seed + i, 1, max_tokens) for i in range(n)])
        _REFS[key] = [o.token_ids for o in outs]
    return _REFS[key]


def _record(llm: LLM) -> list:
    """Wrap the runner: each step's (kind, [(req_id, prefill tokens)], block copies, slot
    copies, shared blocks of its requests) as it runs."""
    log, runner = [], llm.engine.runner
    run = runner.execute

    def execute(plan):
        shared = sum(llm.kv_pools.shared(r.block_tables) for r in plan.reqs)
        log.append((plan.kind, [(r.req_id, n) for r, n in zip(plan.reqs, plan.chunk_lens)],
                    list(plan.copies.blocks), list(plan.copies.slots), shared))
        return run(plan)
    runner.execute = execute
    return log


def _assert_pools_whole(llm: LLM) -> None:
    assert llm.kv_pools.num_free == llm.kv_pools.capacity
    assert llm.slots.num_free == llm.slots.capacity
    assert not llm.scheduler.has_unfinished()


@pytest.mark.parametrize("num_spec", [0, 3])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sample_i_equals_seed_plus_i_and_the_prompt_is_prefilled_once(family, num_spec):
    """Two prompts (last token starting a block / inside a shared block) with n=3: each
    sample's tokens are those of an n=1 request of seed + i without drafts; the prompt's
    L - 1 positions are prefilled once, then each sample prefills the last token; the
    prompt's blocks are shared while the samples run, a shared partial block is copied once
    per writer but the last, and the state slots are copied (Qwen3-Next) for every fork."""
    llm = _llm(family, num_spec)
    prompts = [_prompt(ALIGNED), _prompt(UNALIGNED, 1)]
    log = _record(llm)
    try:
        outs = llm.generate(prompts, _sp(SEED, N))
    finally:
        del llm.engine.runner.execute
    for p, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == list(range(N))
        assert [c.token_ids for c in out.outputs] == _refs(family, p), f"prompt of {len(p)} tokens"
        assert out.token_ids == out.outputs[0].token_ids and out.request_id == out.outputs[0].request_id
        assert len({c.request_id for c in out.outputs}) == N
        assert all(c.finish_reason == "length" for c in out.outputs)
        ids = [c.request_id for c in out.outputs]
        prefilled = [sum(n for step in log if step[0] == StepKind.PREFILL for rid, n in step[1] if rid == i)
                     for i in ids]
        assert prefilled == [len(p)] + [1] * (N - 1), prefilled          # L - 1 + 1, then 1 each
    copies = [c for step in log for c in step[2]]
    # UNALIGNED's last position lies in a block all N share: N - 1 writers copy it, the last
    # writes in place, in every pool (Gemma 4: full and sliding); ALIGNED's starts a fresh
    # block: nothing copied.
    assert len(copies) == (N - 1) * len(llm.kv_pools.pools), copies
    slot_copies = sum(len(step[3]) for step in log)
    assert slot_copies == (0 if llm.slots.stateless else 2 * (N - 1) * llm.engine_config.bundle)
    assert max(step[4] for step in log) >= 2, "the prompt's blocks were never shared"
    _assert_pools_whole(llm)


def test_drafts_stream_stats_and_chat():
    """With drafts: stream events name their sample; stats count every sample; chat takes n."""
    llm = _llm("qwen3_next", 3)
    prompt = _prompt(UNALIGNED, 2)
    llm.stats = SpecStats(num_spec=3)
    events = list(llm.stream(prompt, _sp(SEED + 7, N)))
    got = {i: [] for i in range(N)}
    for ev in events:
        got[ev.sample_index] += ev.new_token_ids
        assert ev.output.outputs[ev.sample_index].token_ids[-len(ev.new_token_ids) or None:] == ev.new_token_ids \
            or not ev.new_token_ids
    assert [got[i] for i in range(N)] == _refs("qwen3_next", prompt, SEED + 7)
    assert sum(ev.finished for ev in events) == N and events[-1].output.finished
    final = events[-1].output
    assert llm.stats.verify_steps == sum(c.spec_stats.verify_steps for c in final.outputs) > 0
    assert llm.stats.num_accepted == sum(c.spec_stats.num_accepted for c in final.outputs) > 0
    [reply] = llm.chat([{"role": "user", "content": "hi"}], _sp(5, 2, 6),
                       chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert len(reply.outputs) == 2 and all(len(c.token_ids) == 6 for c in reply.outputs)
    _assert_pools_whole(llm)


def test_stop_strings_and_logprobs_per_sample():
    """Each sample matches stop strings in its own text and has its own logprobs; the prompt's
    logprobs are computed once and given to every sample: all as separate seed + i requests."""
    llm = _llm("qwen3_next", 3)
    kw = {"temperature": 1.0, "max_tokens": 16, "stop": ["\n"], "logprobs": 2, "prompt_logprobs": 1}
    out = llm.generate("def f(x):", SamplingParams(n=N, seed=21, **kw))[0]
    refs = llm.generate(["def f(x):"] * N, [SamplingParams(seed=21 + i, **kw) for i in range(N)])
    assert [c.text for c in out.outputs] == [r.text for r in refs]
    assert [c.finish_reason for c in out.outputs] == [r.finish_reason for r in refs]
    assert "stop" in {c.finish_reason for c in out.outputs}
    for c, r in zip(out.outputs, refs):
        assert [list(d) for d in c.logprobs] == [list(d) for d in r.logprobs]
        assert all(abs(d[t].logprob - e[t].logprob) < 1e-9 for d, e in zip(c.logprobs, r.logprobs) for t in d)
    ours, theirs = out.prompt_logprobs, refs[0].prompt_logprobs
    assert ours[0] is None and len(ours) == len(theirs) == len(out.prompt_token_ids)
    assert all(abs(d[t].logprob - e[t].logprob) < 1e-9 for d, e in zip(ours[1:], theirs[1:]) for t in d)
    _assert_pools_whole(llm)


@pytest.mark.parametrize("num_spec", [0, 3])
def test_preempted_samples_recompute_from_their_own_tokens(num_spec):
    """A pool too small for the samples at once: samples are preempted and recomputed from
    their own prompt + outputs (no sharing then); every sample still equals its seed + i
    reference, the others unchanged; the pools are whole afterwards."""
    per_seq = -(-(F64["max_model_len"] + 2 * 3) // BLOCK)
    llm = _llm("qwen3_next", num_spec, num_blocks=1 + per_seq + 2)
    prompts = [_prompt(UNALIGNED, 3), _prompt(ALIGNED, 4)]
    outs = llm.generate(prompts, _sp(SEED + 1, N, 30))
    assert sum(c.num_preemptions for o in outs for c in o.outputs[1:]) > 0, "no forked sample was preempted"
    for p, o in zip(prompts, outs):
        assert [c.token_ids for c in o.outputs] == _refs("qwen3_next", p, SEED + 1, N, 30)
    _assert_pools_whole(llm)


def test_abort_of_one_sample_leaves_the_others():
    """LLM.abort of sample 1's id (before it forked, and once running): it ends with "abort",
    the others run to the end with their reference tokens; closing the stream aborts all."""
    llm = _llm("qwen3_next", 3)
    prompt = _prompt(UNALIGNED, 5)
    for when in ("queued", "running"):
        reqs = llm.add_request(prompt, _sp(SEED + 2, N)).samples
        if when == "running":
            while not reqs[1].output_token_ids:
                llm.step()
        assert llm.abort(reqs[1].req_id) == [reqs[1].req_id]
        while llm.scheduler.has_unfinished():
            llm.step()
        ref = _refs("qwen3_next", prompt, SEED + 2)
        assert reqs[1].finish_reason == "abort"
        assert [reqs[i].output_token_ids for i in (0, 2)] == [ref[0], ref[2]], when
        _assert_pools_whole(llm)
    # aborting sample 0 before the fork: the next sample prefills the prompt for the rest
    reqs = llm.add_request(prompt, _sp(SEED + 2, N)).samples
    llm.abort(reqs[0].req_id)
    while llm.scheduler.has_unfinished():
        llm.step()
    assert [r.output_token_ids for r in reqs[1:]] == ref[1:]
    _assert_pools_whole(llm)
    # the call: every sample
    stream = llm.stream(prompt, _sp(SEED + 2, N))
    next(stream)
    stream.close()
    _assert_pools_whole(llm)


def test_bad_n_is_refused_before_queueing():
    llm = _llm("qwen3_next", 0, max_num_seqs=4)
    cases = [(SamplingParams(n=0, temperature=1.0), "n=0 must be an int >= 1"),
             (SamplingParams(n=2.5, temperature=1.0), "n=2.5 must be an int"),
             (SamplingParams(n=True, temperature=1.0), "n=True must be an int"),
             (SamplingParams(n=2), "set temperature > 0"),
             (SamplingParams(n=5, temperature=1.0), "raise max_num_seqs to at least 5")]
    for sp, msg in cases:
        with pytest.raises(InputError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            llm.generate(_prompt(5), sp)
        assert not llm.scheduler.has_unfinished()
    # n=1 and a one-token prompt (nothing to share): ordinary requests
    one = llm.generate([7], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4))[0]
    assert [c.token_ids for c in one.outputs] == [
        o.token_ids for o in llm.generate([[7]] * 3, [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=4)
                                                      for i in range(3)])]


@pytest.fixture(scope="module")
def gemma_sliding(tmp_path_factory):
    """The embedded tiny-gemma4 with a sliding window of 5 (its weights, another mask)."""
    from mtpkit.checkpoint.hub import resolve_model
    src, path = resolve_model("tiny-gemma4"), tmp_path_factory.mktemp("gemma4_n") / "window5"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 5
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "mtpkit.json").unlink(missing_ok=True)    # no assistant: a draft model of its own family
    return path


def test_gemma4_sliding_recycling_respects_shared_blocks(gemma_sliding):
    """Gemma 4 with a sliding window of 5 in blocks of 4, recycling on, and a draft model
    (its own full and sliding KV in the same pools): a prompt of 14 tokens forks 3 samples
    that share its blocks; each sample's sliding pool frees the blocks below its window as it
    advances, which must only drop a reference. Every block freed for good is poisoned with
    NaN: a shared block freed early would be read as NaN by another sample. Each sample
    equals its seed + i reference; the pools are whole afterwards."""
    base = {"dtype": "float64", "device": "cpu", "max_model_len": 80, "block_size": 4, "max_num_batched_tokens": 8}
    llm = LLM(gemma_sliding, num_spec=3, draft_model=gemma_sliding, **base)
    pool = next(p for p in llm.engine.cache_spec.pools if p.sliding_window)
    groups = [g.name for g in pool.groups]
    tensors = [t for g in groups for kv in llm.cache.kv[g] for t in kv]
    alloc, freed = llm.kv_pools[pool.name], []
    orig = alloc.free

    def free(blocks):
        orig(blocks)
        # freed for good: no holder and not kept by the prefix cache (a cached block is read again by a hit)
        gone = [b for b in blocks if alloc.refcount(b) == 0 and not (alloc.cache and b in alloc.cache.lru)]
        for t in tensors:
            t[gone] = float("nan")
        freed.extend(gone)
    alloc.free = free
    prompt = _prompt(14, 6)
    sp = SamplingParams(n=N, temperature=1.0, seed=77, max_tokens=20, ignore_eos=True)
    log = _record(llm)
    out = llm.generate(prompt, sp)[0]
    ref = llm.generate([prompt] * N, [SamplingParams(temperature=1.0, seed=77 + i, max_tokens=20, ignore_eos=True)
                                      for i in range(N)])
    assert [c.token_ids for c in out.outputs] == [o.token_ids for o in ref]
    assert any(step[4] >= 2 for step in log) and freed
    assert llm.kv_pools.num_free == llm.kv_pools.capacity


def test_pool_sharing_and_copy_on_write_rules():
    """The pool layer alone: a fork shares every held block (one reference more), a write
    into a shared block copies it (all or nothing: too few free blocks copies none), a write
    into a block held once does not, and blocks return to the free list with their last
    holder, a sliding pool's recycled ones included."""
    from mtpkit.engine.kv_pools import KVPools
    from mtpkit.step.cache_spec import CacheSpec, KVGroup
    spec = CacheSpec(kv=(KVGroup("f", 1, 1, 8), KVGroup("s", 1, 1, 8, sliding_window=5)))
    pools = KVPools(spec.pools, {"full": 12, "sliding_5": 12}, block_size=4, max_positions=64, read_back=0)
    parent = pools.new_tables()
    assert pools.ensure(parent, 0, 10)                       # positions 0..9: blocks 0, 1, 2 (2 partly)
    child = pools.fork(parent)
    assert pools.shared(parent) == pools.shared(child) == 6
    assert pools.num_free == {"full": 8, "sliding_5": 8}
    copies = []
    assert pools.ensure(child, 10, 14, copies)               # writes 10..13: block 2 copied, block 3 new
    assert [(k, src) for k, src, _ in copies] == [(0, parent[0].ids[2]), (1, parent[1].ids[2])]
    assert [t.ids[2] for t in child] == [dst for _, _, dst in copies]
    assert pools.shared(child) == 3                          # full 0, 1 and sliding 1 (sliding 0 recycled)
    assert pools["sliding_5"].refcount(parent[1].ids[0]) == 1
    more = []
    assert pools.ensure(parent, 10, 14, more) and not more   # block 2 is the parent's alone now
    pools.release(parent)
    assert pools.shared(child) == 0
    tight = KVPools(spec.pools, {"full": 5, "sliding_5": 5}, block_size=4, max_positions=64, read_back=0)
    a = tight.new_tables()
    assert tight.ensure(a, 0, 14)
    b, none = tight.fork(a), []
    # no free block for the copies: none made (the sliding blocks below the window still return)
    assert not tight.ensure(b, 13, 14, none) and none == [] and tight.shared(b) == 4 + 2
    for t in (a, b):
        tight.release(t)
    pools.release(child)
    assert pools.num_free == pools.capacity and tight.num_free == tight.capacity
