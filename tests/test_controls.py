"""Generation controls (SamplingParams repetition / presence / frequency penalties, min_p,
logit_bias, allowed_token_ids, bad_words, min_tokens): lossless under speculation (greedy
with num_spec 1..6 == without drafts, seeded sampling too), equal to transformers'
repetition penalty and to the OpenAI formula written out, min_p by chi-square, mixed
batches, bad words across draft positions, min_tokens against drafted stop tokens,
preemption, validation, generation_config.json and the CLI flags.

Float64 random models of both families: a Qwen3-Next whose MTP head is a bigram model
accepted often (spec_models), and a Gemma 4 drafted by a draft model with its own weights
(every draft accepted without controls; the controls make the target disagree).
"""

import collections
import json

import pytest
import torch

import gemma4_oracle as G
import oracle
import spec_models
from spec_metrics import chi2_pvalue
from mtpkit import LLM, InputError, SamplingParams

F64 = dict(dtype="float64", device="cpu", max_model_len=96)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = spec_models.build_spec_checkpoint(tmp_path_factory.mktemp("ctl") / "qwen",
                                             dict(oracle.TINY_CONFIGS["base"]), seed=1, mode="bigram", eps=0.3)
    return dict(path=path, vocab=oracle.TINY_CONFIGS["base"]["vocab_size"], kw={})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctl") / "gemma"
    G.save(G.build_hf("dense", seed=3), path)
    return dict(path=path, vocab=G.CONFIGS["dense"]["vocab_size"], kw=dict(draft_model=path))


def _llm(m, k, **kw):
    return LLM(m["path"], num_spec=k, **F64, **(m["kw"] if k else {}), **kw)


def _greedy(**kw):
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def _control_cases(plain: list[list[int]], vocab: int) -> list[SamplingParams]:
    """One request per control, its values chosen from the uncontrolled output of its prompt
    so that each changes what is generated."""
    common = [collections.Counter(o).most_common(1)[0][0] for o in plain]
    gen = torch.Generator().manual_seed(0)
    allowed = sorted(torch.randperm(vocab, generator=gen)[:vocab // 3].tolist())
    return [
        _greedy(repetition_penalty=1.8),
        _greedy(presence_penalty=1.5, frequency_penalty=2.0),
        _greedy(logit_bias={common[2]: -30.0, (common[2] + 1) % vocab: 2.0}),
        _greedy(allowed_token_ids=allowed),
        _greedy(bad_words=[[plain[4][3], plain[4][4]], [plain[4][9]]]),     # a pair and a single token
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[plain[5][2]], min_tokens=10),
        _greedy(),                                                           # a row without controls
    ]


@pytest.fixture(scope="module", params=["qwen", "gemma"])
def family(request):
    """The model, its prompts, the control cases and their outputs without drafts."""
    m = request.getfixturevalue(request.param)
    prompts = oracle.random_prompts(7, m["vocab"], seed=4, lengths=[5, 9, 3, 12, 7, 4, 6])
    llm = _llm(m, 0)
    plain = [o.token_ids for o in llm.generate(prompts, _greedy())]
    cases = _control_cases(plain, m["vocab"])
    ref = [o.token_ids for o in llm.generate(prompts, cases)]
    return dict(m, name=request.param, prompts=prompts, plain=plain, cases=cases, ref=ref)


def test_each_control_changes_the_output_as_defined(family):
    """Without drafts: every control changes its prompt's output (else the losslessness test
    below could not fail), and what it must guarantee holds."""
    plain, ref, cases = family["plain"], family["ref"], family["cases"]
    for i in range(6):
        assert ref[i] != plain[i], f"{family['name']}: control {i} ({cases[i]}) changed nothing"
    assert ref[6] == plain[6]
    assert set(ref[3]) <= set(cases[3].allowed_token_ids)
    pair, single = cases[4].bad_words
    assert single[0] not in ref[4] and all(ref[4][i:i + 2] != pair for i in range(len(ref[4]) - 1))
    stop = cases[5].stop_token_ids[0]
    assert stop not in ref[5][:10] and (stop not in ref[5] or ref[5][-1] == stop)
    assert cases[2].logit_bias and next(iter(cases[2].logit_bias)) not in ref[2]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_controls_are_lossless(family, k):
    """Greedy output with num_spec k equals the output without drafts, token for token, for
    every control, in one batch with a row that uses none."""
    llm = _llm(family, k, max_num_seqs=4)
    outs = llm.generate(family["prompts"], family["cases"])
    assert [o.token_ids for o in outs] == family["ref"], f"{family['name']} num_spec={k}: {llm.stats}"
    assert llm.stats.num_accepted > 0, "no draft was accepted: the drafts' positions were not exercised"
    if k == 3:
        assert llm.stats.num_accepted < llm.stats.num_drafted, "no draft was rejected"
