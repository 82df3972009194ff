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
    assert llm.blocks.num_free == llm.blocks.num_blocks - 1


def test_stats_aggregate_over_requests(ck):
    llm = LLM(ck, dtype="float64", num_spec=3)
    outs = llm.generate([[1, 2], [3, 4, 5]], SamplingParams(max_tokens=7, ignore_eos=True))
    s = llm.stats
    assert s.verify_steps == sum(o.spec_stats.verify_steps for o in outs)
    assert s.num_drafted == sum(o.spec_stats.num_drafted for o in outs)
    assert len(s.acceptance_rate_per_position) == 3
