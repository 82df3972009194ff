"""Facade behaviour not covered elsewhere: dummy weights, streaming, score, stats."""

import json

import pytest
import torch

import oracle
from mtpkit import LLM, ConfigError, SamplingParams


@pytest.fixture(scope="module")
def ck(hf_checkpoint):
    return hf_checkpoint("base", 0)[1]


def test_dummy_weights_are_deterministic_and_need_only_config(tmp_path):
    cfg = dict(oracle.TINY_CONFIGS["base"], model_type="qwen3_next")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = LLM(tmp_path, load_format="dummy", num_spec=2, dtype="float32", seed=3)
    b = LLM(tmp_path, load_format="dummy", num_spec=2, dtype="float32", seed=3, enforce_eager=True)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    assert a.generate([[1, 2, 3]], sp)[0].token_ids == b.generate([[1, 2, 3]], sp)[0].token_ids
    with pytest.raises(ConfigError, match="load_format"):
        LLM(tmp_path, load_format="pt")


def test_stream_yields_increments_that_add_up(ck):
    llm = LLM(ck, dtype="float64", num_spec=2)
    prompts = [[1, 2, 3], [9] * 12]
    seen = {0: [], 1: []}
    finished = set()
    for ev in llm.stream(prompts, SamplingParams(max_tokens=9, ignore_eos=True)):
        assert ev.index not in finished
        seen[ev.index] += ev.new_token_ids
        if ev.finished:
            finished.add(ev.index)
            assert ev.output.token_ids == seen[ev.index]
    ref = LLM(ck, dtype="float64").generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
    assert [seen[0], seen[1]] == [o.token_ids for o in ref] and finished == {0, 1}


def test_score_shape_dtype_and_chunking(ck):
    llm = LLM(ck, dtype="float64", max_num_batched_tokens=5)
    ids = list(range(1, 23))
    logits = llm.score(ids)
    assert logits.shape == (22, 256) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, LLM(ck, dtype="float64").score(ids), rtol=0, atol=1e-6)
    # score leaves no blocks or slots behind
    assert llm.kv_pools.num_free == llm.kv_pools.capacity


def test_stats_aggregate_over_requests(ck):
    llm = LLM(ck, dtype="float64", num_spec=3)
    outs = llm.generate([[1, 2], [3, 4, 5]], SamplingParams(max_tokens=7, ignore_eos=True))
    s = llm.stats
    assert s.verify_steps == sum(o.spec_stats.verify_steps for o in outs)
    assert s.num_drafted == sum(o.spec_stats.num_drafted for o in outs)
    assert len(s.acceptance_rate_per_position) == 3


def test_slots_and_blocks_reused_without_leaking_state(ck):
    """max_num_seqs=1: every request reuses the previous one's KV blocks and GDN slots; each
    output equals the output of a fresh engine."""
    prompts = [[7] * 30, [1, 2, 3], list(range(40, 90))]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for k in (0, 2):
        llm = LLM(ck, dtype="float64", num_spec=k, max_num_seqs=1)
        outs = [o.token_ids for o in llm.generate(prompts, sp)]
        fresh = [LLM(ck, dtype="float64", num_spec=k).generate([p], sp)[0].token_ids for p in prompts]
        assert outs == fresh
        assert llm.kv_pools.num_free == llm.kv_pools.capacity and llm.slots.num_free == llm.slots.capacity


def test_preemption_recomputes_without_changing_output(ck):
    """A KV pool that holds two sequences at most: requests are preempted, recomputed from
    prompt + generated tokens, and still produce exactly their greedy outputs."""
    prompts = [list(range(1 + i, 40 + i)) for i in range(4)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for k in (0, 3):
        ref = [o.token_ids for o in LLM(ck, dtype="float64", num_spec=k).generate(prompts, sp)]
        blocks_per_seq = -(-(64 + 2 * k) // 16)
        llm = LLM(ck, dtype="float64", num_spec=k, max_num_seqs=4, max_model_len=64,
                  num_blocks=1 + blocks_per_seq + 2)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == ref
        assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"


def test_pools_sized_from_memory_budgets(ck):
    """The budgets buy exactly the tensors that are allocated: the expectation is counted from
    the cache tensors themselves (every K/V layer, the MTP head's included; every state)."""
    kv_budget, state_budget = 4 << 20, 1 << 20
    llm = LLM(ck, dtype="float32", num_spec=2, kv_cache_memory=kv_budget, state_cache_memory=state_budget)
    kv = [t for layers in llm.cache.kv.values() for pair in layers for t in pair]
    state = [t for layers in llm.cache.state.values() for layer in layers for t in layer.values()]
    cfg = llm.model_config
    assert len(kv) == 2 * (len(cfg.full_layers) + cfg.num_nextn_predict_layers)
    assert len(state) == 2 * len(cfg.linear_layers)
    kv_bytes, state_bytes = sum(t.nbytes for t in kv), sum(t.nbytes for t in state)
    per_block, per_slot = kv_bytes // llm.kv_pool_sizes["full"], state_bytes // llm.cache.num_slots
    assert kv_budget - per_block < kv_bytes <= kv_budget
    assert state_budget - per_slot < state_bytes <= state_budget


def test_chunked_prefills_that_cannot_all_fit_make_progress(ck):
    """Long prompts prefilled in small chunks on a pool that holds about one and a half of
    them: partly prefilled requests are preempted instead of holding the pool between them."""
    prompts = [list(range(1 + i, 100 + i)) for i in range(3)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = [o.token_ids for o in LLM(ck, dtype="float64").generate(prompts, sp)]
    for k in (0, 2):
        max_blocks = -(-(112 + 2 * k) // 16)
        llm = LLM(ck, dtype="float64", num_spec=k, max_model_len=112, max_num_batched_tokens=16,
                  num_blocks=1 + max_blocks + max_blocks // 2)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == ref


def test_constructor_keywords_are_the_engine_arguments():
    """LLM(...) keeps its own signature (help(), editors); every keyword is an EngineArgs field
    with the same default, so the facade and an engine built directly agree."""
    import dataclasses
    import inspect

    from mtpkit.engine.args import EngineArgs
    params = list(inspect.signature(LLM.__init__).parameters.values())[2:]    # after self, model
    fields = dataclasses.fields(EngineArgs)
    assert [p.name for p in params] == [f.name for f in fields]
    assert {p.name: p.default for p in params} == {f.name: f.default for f in fields}
