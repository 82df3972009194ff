"""Sliding-window KV recycling (engine/kv_pools.py) on tiny Gemma 4 models: generations far
longer than the window run in a sliding pool too small for their context, blocks are returned
as requests advance, a block is never read after it is freed (every freed block is poisoned
with NaN at that moment, and the null block that freed table entries point at holds NaN), and
the tokens equal a run that keeps every block and transformers' greedy output."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_oracle as G  # noqa: E402
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.step.cache_spec import CacheSpec, KVGroup  # noqa: E402
from mtpkit.engine.kv_pools import KVPools, blocks_for, window_demand  # noqa: E402

W = G.CONFIGS["dense"]["sliding_window"]        # 5
POOL = f"sliding_{W}"
BLOCK = 4
BASE = dict(dtype="float64", device="cpu", max_model_len=200, block_size=BLOCK, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    model = G.build_hf("dense")
    path = tmp_path_factory.mktemp("gemma4_recycle") / "dense"
    G.save(model, path)
    return model, path


def _poison_on_free(llm) -> list[int]:
    """Every block the sliding pool frees is filled with NaN in every layer of the pool, at the
    moment it is freed; the null block starts as NaN too. Returns the list of freed ids."""
    groups = [g for g, i in llm.cache.pool_index.items() if llm.cache.pool_windows[i] == W]
    assert groups
    tensors = [t for g in groups for kv in llm.cache.kv[g] for t in kv]
    alloc, freed = llm.kv_pools[POOL], []
    orig = alloc.free

    def free(blocks):
        for t in tensors:
            t[blocks] = float("nan")
        freed.extend(blocks)
        orig(blocks)
    alloc.free = free
    for t in tensors:
        t[0] = float("nan")
    return freed


def _run_stepwise(llm, prompts, params):
    """generate() by hand, recording how many sliding blocks the requests hold after each step."""
    reqs = [llm.add_request(p, params) for p in prompts]
    held, free = [], []
    while llm.scheduler.has_unfinished():
        llm.step()
        if all(r.block_tables for r in reqs):       # both still running
            held.append(sum(len(r.block_tables[1].held()) for r in reqs))
            free.append(llm.kv_pools.num_free[POOL])
    return [r.output_token_ids for r in reqs], held, free


@pytest.mark.parametrize("eager,steps", [(True, 1), (False, 1), (False, 3)])
def test_long_generation_in_a_small_sliding_pool(dense, eager, steps):
    """(steps: num_scheduler_steps, decode steps run in a row on blocks ensured for them all)"""
    model, path = dense
    prompts = [O.random_prompt(n, 128, seed=70 + n) for n in (12, 3)]
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    keep = LLM(path, recycle_sliding_kv=False, max_num_seqs=2, enforce_eager=True, **BASE)
    ref = [o.token_ids for o in keep.generate(prompts, params)]
    llm = LLM(path, max_num_seqs=2, enforce_eager=eager, num_scheduler_steps=steps, **BASE)
    assert [p.name for p in llm.engine.cache_spec.pools] == ["full", POOL]
    sliding = llm.kv_pools[POOL]
    context = blocks_for(12 + 150, BLOCK)
    assert sliding.num_blocks - 1 < context, "the sliding pool was meant to be too small for one context"
    assert keep.kv_pools[POOL].num_blocks == keep.kv_pools["full"].num_blocks
    freed = _poison_on_free(llm)
    if not eager:
        llm.runner.graphs.trace_after = 0
    tokens, held, free = _run_stepwise(llm, prompts, params)
    assert tokens == ref
    for p, ours in zip(prompts, tokens):
        report = O.check_greedy_against_hf(model, p, ours)
        assert report.ok, str(report)
    # every block lent was returned (most while the requests ran; the last token's KV is never
    # written), many more than the pool holds
    assert len(freed) == blocks_for(12 + 149, BLOCK) + blocks_for(3 + 149, BLOCK) > 4 * (sliding.num_blocks - 1)
    # never more than each request's window demand at once, whatever the context: over the
    # 100+ steps both requests run, their contexts grow by ~37 blocks each, and the pool's free
    # count stays where the window demand leaves it (each step returns what it takes)
    bound = 2 * window_demand(W, 0, 8, BLOCK)
    assert len(held) > 100 // steps and max(held) <= bound
    if steps > 1:   # the runs happened: most steps emitted `steps` tokens
        assert len(held) < 150 // (steps - 1)
    assert min(free) >= sliding.num_blocks - 1 - bound and free[-1] == free[len(free) // 2]
    assert llm.kv_pools.num_free == llm.kv_pools.capacity
    if not eager:
        graphs = llm.runner.graphs.decode_graphs if steps > 1 else llm.runner.graphs.verify_graphs
        assert graphs, "the decode steps were meant to run as traced graphs"


def test_speculation_preemption_and_score_with_recycling(dense):
    """A Gemma 4 draft model (the target's own weights: most drafts accepted, so bundles move
    several positions a step) drafting num_spec 3 with its own sliding KV in the same pool, in a
    full pool small enough to preempt and recompute: the same tokens as without drafts and
    without recycling. `score` over a long sequence in chunks: the same logits."""
    _, path = dense
    prompts = [O.random_prompt(n, 128, seed=90 + n) for n in (20, 7, 33, 1)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    keep = LLM(path, recycle_sliding_kv=False, max_num_seqs=4, enforce_eager=True, **BASE)
    ref = [o.token_ids for o in keep.generate(prompts, params)]
    per_seq = blocks_for(BASE["max_model_len"] + 3 + 3, BLOCK)
    spec = LLM(path, num_spec=3, draft_model=path, max_num_seqs=4, num_blocks=1 + per_seq + 8, **BASE)
    freed = _poison_on_free(spec)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.num_preemptions for o in outs) > 0, "the full pool was meant to force preemption"
    assert spec.stats.mean_acceptance_length > 2.5
    assert freed and spec.kv_pools.num_free == spec.kv_pools.capacity
    assert {g for g, i in spec.cache.pool_index.items() if i == 1} == {
        g.name for g in spec.engine.cache_spec.kv if g.sliding_window == W}      # the draft's sliding group too

    ids = O.random_prompt(150, 128, seed=99)
    kept, recycled = keep.score(ids), LLM(path, max_num_seqs=1, **BASE)
    assert recycled.kv_pools[POOL].num_blocks - 1 < blocks_for(150, BLOCK)
    _poison_on_free(recycled)
    torch.testing.assert_close(recycled.score(ids), kept, rtol=0, atol=1e-6)


def test_pool_tables_keep_every_block_a_reader_needs():
    """The rule itself: after `ensure` for a step whose first query is at s, every position
    from s - W + 1 - read_back up to the step's end is in a held block, the blocks wholly
    below are returned, and the full pool keeps everything."""
    spec = CacheSpec(kv=(KVGroup("f", 1, 1, 8), KVGroup("s", 1, 1, 8, sliding_window=7)))
    pools = KVPools(spec.pools, {"full": 64, "sliding_7": 16}, block_size=4, max_positions=200, read_back=2)
    tables, s = pools.new_tables(), 0
    for step in [9, 1, 4, 4, 2, 30, 1, 1, 3, 5, 4, 4, 4, 4]:
        assert pools.ensure(tables, s, s + step + 3)
        full, sliding = tables
        assert all(full.ids[: blocks_for(s + step + 3, 4)])
        lo = max(0, s - 7 + 1 - 2)
        assert all(sliding.ids[p // 4] for p in range(lo, s + step + 3))
        assert not any(sliding.ids[: lo // 4])
        assert len(sliding.held()) <= window_demand(7, 2, step + 3, 4)
        assert pools["sliding_7"].num_free == 15 - len(sliding.held())
        s += step
    pools.release(tables)
    assert pools.num_free == pools.capacity


@pytest.mark.parametrize("recycle", [True, False])
def test_memory_benchmark_counts_what_the_engine_allocates(tmp_path, recycle):
    """benchmarks/memory_gemma4.py's byte counts (meta device) equal the KV tensors an LLM
    allocates for the same config and settings."""
    import json
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import memory_gemma4
    raw = dict(G.CONFIGS["dense"], model_type="gemma4_text")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    llm = LLM(tmp_path, load_format="dummy", dtype="float32", device="cpu", max_model_len=100, max_num_seqs=3,
              block_size=BLOCK, max_num_batched_tokens=8, recycle_sliding_kv=recycle)
    allocated = sum(t.nbytes for layers in llm.cache.kv.values() for kv in layers for t in kv)
    counted = memory_gemma4.kv_bytes(raw, context=100, recycle=recycle, max_num_seqs=3, block_size=BLOCK,
                                     max_num_batched_tokens=8, dtype=torch.float32)
    assert sum(counted.values()) == allocated
    assert (counted[POOL] < counted["full"]) == recycle
