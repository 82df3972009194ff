"""Parity of mtpkit's Gemma 4 with transformers 5.24 on tiny random checkpoints
(tests/gemma4_oracle.py: dense with attention_k_eq_v and other full-layer geometry, MoE,
E2B-like with per-layer embeddings / KV-shared layers / double-wide MLP, and the
ForConditionalGeneration layout with its towers in the checkpoint), every sliding window
shorter than the prompts.

- `score` logits (float64 engine vs HF float64, whose norms and RoPE run in float32) within
  1e-4 of the per-position logit scale at every position;
- chunked prefill whose chunks cross the window equals one-shot prefill to 1e-10;
- greedy, 48 new tokens, prompts of different lengths run together (chunked prefill) and one
  by one, each compared tie-aware with HF's cached greedy (tests/oracle.py).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_oracle as G  # noqa: E402
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

from mtpkit import LLM, SamplingParams  # noqa: E402

NAMES = sorted(G.CONFIGS)
REL_TOL = 1e-4
NEW_TOKENS = 48
LENGTHS = (1, 6, 23, 40)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF model, checkpoint directory), built once."""
    root, out = tmp_path_factory.mktemp("gemma4"), {}

    def get(name):
        if name not in out:
            model = G.build_hf(name)
            G.save(model, root / name)
            out[name] = (model, root / name)
        return out[name]

    return get


def _llm(path, **kw):
    return LLM(path, dtype="float64", device="cpu", max_model_len=160, enforce_eager=True, **kw)


def _score(llm, ids):
    """The float64 logits behind LLM.score (it returns float32)."""
    captured, orig = [], llm.model.compute_logits
    llm.model.compute_logits = lambda h: captured.append(orig(h)) or captured[-1]
    try:
        llm.score(ids)
    finally:
        del llm.model.compute_logits
    return torch.cat(captured)


def _prompt(n, seed):
    return O.random_prompt(n, 128, seed)


@pytest.mark.parametrize("name", NAMES)
def test_score_matches_hf_every_position(name, checkpoints):
    model, path = checkpoints(name)
    llm = _llm(path)
    for ids in (_prompt(40, 11), _prompt(1, 12)):
        ref, ours = G.hf_logits(model, ids), _score(llm, ids)
        assert ours.shape == ref.shape
        rel = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
        assert rel.max() < REL_TOL, (name, len(ids), rel.max().item(), rel.argmax().item())


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_crossing_the_window_equals_one_shot(name, checkpoints):
    _, path = checkpoints(name)
    ids = _prompt(40, 13)
    one = _score(_llm(path), ids)
    chunked = _score(_llm(path, max_num_batched_tokens=3), ids)   # windows are 4..7
    torch.testing.assert_close(chunked, one, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_hf_batch_and_one_by_one(name, checkpoints):
    model, path = checkpoints(name)
    prompts = [_prompt(n, 20 + n) for n in LENGTHS]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    # Chunks of 16 tokens: prompts are split across steps and mixed with decoding requests.
    llm = _llm(path, max_num_seqs=4, max_num_batched_tokens=16)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    checked = {}
    for p, a, b in zip(prompts, together, alone):
        for ours in (a, b):
            assert len(ours) == NEW_TOKENS
            key = tuple(ours)
            if key not in checked:
                checked[key] = O.check_greedy_against_hf(model, p, ours)
            assert checked[key].ok, f"{name} prompt of {len(p)}: {checked[key]}"


@pytest.mark.parametrize("path_", ["grouped", "sparse"])
def test_moe_execution_paths_match_hf(checkpoints, monkeypatch, path_):
    """The MoE layer's other two execution paths (the tests above take the dense one): the
    grouped loop over the experts hit (prefill of many tokens) and the gather of the chosen
    experts (decode steps choosing few of many experts), forced by their thresholds."""
    from mtpkit.models.gemma4.model import Gemma4Experts
    model, path = checkpoints("moe")
    if path_ == "grouped":
        monkeypatch.setattr(Gemma4Experts, "dense_limit", 0)
    else:
        monkeypatch.setattr(Gemma4Experts, "sparse_share", 1)    # 1 token x top-2 <= 8 experts
    llm = _llm(path)
    ids = _prompt(40, 11)
    ref, ours = G.hf_logits(model, ids), _score(llm, ids)
    assert ((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max() < REL_TOL
    prompt = _prompt(7, 14)
    tokens = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    report = O.check_greedy_against_hf(model, prompt, tokens)
    assert report.ok, str(report)
