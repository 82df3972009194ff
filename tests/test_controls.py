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

import gemma4_oracle as G
import oracle
import pytest
import spec_models
import torch
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
    every control, in one batch with a row that uses none; at num_spec 3 the verify and propose
    bodies replay as CPU traces from the first step (static buffers, padded rows)."""
    llm = _llm(family, k, max_num_seqs=4)
    if k == 3:
        llm.runner.graphs.trace_after = 0
    outs = llm.generate(family["prompts"], family["cases"])
    assert [o.token_ids for o in outs] == family["ref"], f"{family['name']} num_spec={k}: {llm.stats}"
    if k == 3:
        assert llm.runner.graphs.verify_graphs, "the verify steps were meant to replay traces"
    assert llm.stats.num_accepted > 0, "no draft was accepted: the drafts' positions were not exercised"
    if k == 3:
        assert llm.stats.num_accepted < llm.stats.num_drafted, "no draft was rejected"


def test_min_tokens_bans_stop_ids_drafted_before_it(qwen):
    """min_tokens under speculation. A stop token t the greedy output first reaches at index m
    (the bigram drafter proposes it): with min_tokens m + 1 it is banned there, so a drafted t
    is rejected and the output goes on; with min_tokens m it is allowed from that position,
    which a bundle that began before it covers. Both as without drafts."""
    prompts = oracle.random_prompts(4, qwen["vocab"], seed=21, lengths=[6, 11, 4, 8])
    plain = [o.token_ids for o in _llm(qwen, 0).generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    cases = []
    for p, out in enumerate(plain):
        firsts = [m for m in range(3, 12) if out[m] not in out[:m]][:3]
        cases += [(p, out[m], m, mm) for m in firsts for mm in (m, m + 1)]
    sps = [SamplingParams(max_tokens=24, stop_token_ids=[t], min_tokens=mm, ignore_eos=True) for _, t, _, mm in cases]
    ps = [prompts[p] for p, *_ in cases]
    ref = _llm(qwen, 0, max_num_seqs=32).generate(ps, sps)
    for (p, t, m, mm), o in zip(cases, ref):
        if mm == m:
            assert o.token_ids == plain[p][:m + 1] and o.finish_reason == "stop"
        else:
            assert o.token_ids[:m] == plain[p][:m] and t not in o.token_ids[:m + 1] and len(o.token_ids) > m + 1
    llm = _llm(qwen, 3, max_num_seqs=32)
    outs = llm.generate(ps, sps)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert 0 < llm.stats.num_accepted < llm.stats.num_drafted


def test_bad_words_across_draft_positions(family):
    """A two-token bad word whose first token the step verifies as a draft: its second token
    is banned at the next bundle position (the draft is its prefix), as without drafts."""
    llm = _llm(family, 3, max_num_seqs=8)
    spec = llm.generate(family["prompts"], _greedy())
    words = []
    for o in spec:    # (t_m, t_m+1) with t_m an accepted draft: m+1 is decided in the same bundle
        m = next((m for m in range(1, len(o.token_ids) - 1) if o.token_draft_positions[m] >= 1
                  and o.token_draft_positions[m + 1] >= 1), None)
        words.append(None if m is None else o.token_ids[m:m + 2])
    rows = [i for i, w in enumerate(words) if w is not None]
    assert len(rows) >= 2, "too few drafted pairs"
    sps = [_greedy(bad_words=[words[i]]) for i in rows]
    prompts = [family["prompts"][i] for i in rows]
    ref = [o.token_ids for o in _llm(family, 0).generate(prompts, sps)]
    got = [o.token_ids for o in llm.generate(prompts, sps)]
    assert got == ref
    for i, toks in zip(rows, ref):
        assert toks != spec[i].token_ids and all(toks[j:j + 2] != words[i] for j in range(len(toks) - 1))


def _sampled(**kw):
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.6, **kw)


def test_seeded_sampling_with_controls_is_lossless(family):
    """Seeded sampling with min_p, penalties, bias and min_tokens: the same tokens with drafts
    (num_spec 2 and 5, in another batch order) as without."""
    vocab = family["vocab"]
    sps = [_sampled(min_p=0.2, seed=1), _sampled(repetition_penalty=0.5, seed=2),
           _sampled(presence_penalty=-2.0, frequency_penalty=0.5, top_p=0.9, seed=3),
           _sampled(logit_bias={t: 3.0 for t in range(0, vocab, 7)}, min_p=0.05, seed=4),
           _sampled(min_tokens=5, stop_token_ids=list(range(0, vocab, 5)), seed=5), _sampled(seed=6)]
    prompts = family["prompts"][:6]
    ref = [o.token_ids for o in _llm(family, 0).generate(prompts, sps)]
    plain = [o.token_ids for o in _llm(family, 0).generate(prompts, [_sampled(seed=s) for s in range(1, 7)])]
    assert [a != b for a, b in zip(ref, plain)] == [True] * 5 + [False], "a control changed nothing"
    for k in (2, 5):
        llm = _llm(family, k, max_num_seqs=3)
        outs = llm.generate(prompts[::-1], sps[::-1])
        assert [o.token_ids for o in outs][::-1] == ref, f"num_spec={k}"
        assert llm.stats.num_accepted > 0


def test_mixed_batch_rows_without_controls_are_untouched(qwen):
    """Greedy and random rows, controls on some only: the rows without controls give exactly
    the tokens of a batch in which no row uses one, the controlled rows those they give alone."""
    prompts = oracle.random_prompts(6, qwen["vocab"], seed=8, lengths=[4, 10, 6, 3, 9, 5])
    plain = [_greedy(), _sampled(seed=11), _greedy(), _sampled(seed=12, top_k=20), _greedy(), _sampled(seed=13)]
    mixed = list(plain)
    mixed[0] = _greedy(repetition_penalty=1.6, logit_bias={3: 4.0})
    mixed[3] = _sampled(seed=12, top_k=20, min_p=0.1, frequency_penalty=1.0, bad_words=[[5], [6, 7]])
    mixed[4] = _greedy(allowed_token_ids=list(range(40, 120)), min_tokens=3, stop_token_ids=[41])
    llm = _llm(qwen, 3, max_num_seqs=6)
    a = [o.token_ids for o in llm.generate(prompts, plain)]
    b = [o.token_ids for o in llm.generate(prompts, mixed)]
    for i in (1, 2, 5):
        assert a[i] == b[i], f"row {i} without controls changed"
    for i in (0, 3, 4):
        assert a[i] != b[i], f"row {i}: its controls changed nothing"
        assert b[i] == llm.generate(prompts[i], mixed[i])[0].token_ids


def test_preemption_keeps_penalty_counts(qwen):
    """On pools that force preemption (a request recomputed from prompt + outputs, its counts
    rebuilt from its tokens): penalised greedy and seeded rows give the tokens of a free pool."""
    prompts = oracle.random_prompts(6, qwen["vocab"], seed=9, lengths=[30, 25, 33, 28, 20, 31])
    sps = [SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.7),
           SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=5, presence_penalty=1.2),
           SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=1.5, bad_words=[[9, 9]]),
           SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=6, repetition_penalty=1.3)] * 2
    prompts = prompts + prompts[:2]
    free = _llm(qwen, 3).generate(prompts, sps)
    tight = _llm(qwen, 3, num_blocks=13).generate(prompts, sps)
    assert sum(o.num_preemptions for o in tight) > 0, "the pool was meant to force preemption"
    assert [o.token_ids for o in tight] == [o.token_ids for o in free]


# ---- oracles ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,pen", [("qwen", 1.3), ("gemma", 0.7)])
def test_repetition_penalty_equals_transformers(request, name, pen):
    """Greedy with repetition_penalty (over prompt and output tokens; > 1 and < 1), with
    drafts, equals transformers: Gemma 4's generate(repetition_penalty=...) token for token;
    for Qwen3-Next (whose torch GDN path decodes slowly in transformers) the argmax of
    transformers' RepetitionPenaltyLogitsProcessor over its logits at every position."""
    from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

    m = request.getfixturevalue(name)
    prompts = oracle.random_prompts(2, m["vocab"], seed=31, lengths=[5, 12])
    llm = _llm(m, 3)
    outs = llm.generate(prompts, _greedy(repetition_penalty=pen))
    plain = llm.generate(prompts, _greedy())
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain))
    assert llm.stats.num_accepted > 0
    if name == "gemma":
        hf = G.build_hf("dense", seed=3)
        gc = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, repetition_penalty=pen, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None)
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p])
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)[0, len(p):]
            assert o.token_ids == ref.tolist(), f"{name} repetition_penalty={pen}"
        return
    hf = oracle.load_hf_model(m["path"], dtype=torch.float64)
    proc = RepetitionPenaltyLogitsProcessor(pen)
    for p, o in zip(prompts, outs):
        seq = p + o.token_ids
        logits = oracle.hf_logits(hf, seq)
        for i, t in enumerate(o.token_ids):
            n = len(p) + i
            scores = proc(torch.tensor([seq[:n]]), logits[n - 1][None].clone())[0]
            top2 = scores.topk(2).values
            assert t == int(scores.argmax()) or top2[0] - top2[1] < 1e-9, f"token {i}"


@pytest.mark.parametrize("pres,freq,seed", [(0.8, 0.6, 21), (-1.5, 1.0, 41)])
def test_presence_frequency_equal_the_openai_formula(qwen, pres, freq, seed):
    """Greedy tokens and processed logprobs with presence / frequency penalties equal the
    OpenAI formula written out over transformers' logits at each position: logit[t] -
    presence * (count[t] > 0) - frequency * count[t], count over the output so far (a
    negative presence penalty makes tokens repeat, so counts above 1 are exercised)."""
    hf = oracle.load_hf_model(qwen["path"], dtype=torch.float64)
    # prompts whose greedy output repeats a token (seed 21), or never does (41)
    prompts = oracle.random_prompts(2, qwen["vocab"], seed=seed, lengths=[6, 11 if seed == 21 else 13])
    llm = _llm(qwen, 3)
    outs = llm.generate(prompts, _greedy(presence_penalty=pres, frequency_penalty=freq, logprobs=2,
                                         logprobs_mode="processed"))
    plain = llm.generate(prompts, _greedy())
    assert any(o.token_ids != q.token_ids for o, q in zip(outs, plain))
    repeats = 0
    for p, o in zip(prompts, outs):
        logits = oracle.hf_logits(hf, p + o.token_ids)
        counts = collections.Counter()
        for i, t in enumerate(o.token_ids):
            row = [x - pres * (counts[v] > 0) - freq * counts[v] for v, x in enumerate(logits[len(p) - 1 + i].tolist())]
            ref = torch.log_softmax(torch.tensor(row, dtype=torch.float64), -1)
            assert t == int(ref.argmax()), f"token {i}"
            assert abs(o.logprobs[i][t].logprob - ref[t].item()) < 1e-6
            counts[t] += 1
        repeats += len(o.token_ids) - len(counts)
    assert repeats > 0 or pres > 0, "no token repeated: counts above 1 were not exercised"


def test_min_p_distribution_by_chi_square(qwen):
    """min_p: over many seeds the first sampled token's distribution is softmax(logits / T)
    restricted to p >= min_p * max p, renormalised (chi-square); nothing below it is drawn."""
    hf = oracle.load_hf_model(qwen["path"], dtype=torch.float64)
    prompt = oracle.random_prompt(7, qwen["vocab"], seed=51)
    T, min_p, n, vocab = 1.5, 0.15, 1000, qwen["vocab"]
    p = torch.softmax(oracle.hf_logits(hf, prompt)[-1] / T, -1)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    p = p / p.sum()
    assert 5 <= int((p > 0).sum()) <= 60
    llm = LLM(qwen["path"], **{**F64, "max_model_len": 16}, max_num_seqs=256)
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=1, temperature=T, min_p=min_p, seed=s)
                                       for s in range(n)])
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=qwen["vocab"])
    assert int(counts[p == 0].sum()) == 0
    assert chi2_pvalue(counts, p) > 1e-3
    # processed logprobs are those of this distribution (-inf below the threshold)
    out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=T, min_p=min_p, seed=0, logprobs=vocab,
                                              logprobs_mode="processed"))[0]
    lp = torch.tensor([out.logprobs[0][t].logprob for t in range(vocab)], dtype=torch.float64)
    assert torch.equal(lp == float("-inf"), p == 0)
    torch.testing.assert_close(lp[p > 0].exp(), p[p > 0], rtol=0, atol=1e-6)   # target_probs is fp32


# ---- validation, defaults, the CLI ----------------------------------------------------------

BAD = [
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values"), (dict(logit_bias={300: 1.0}), "logit_bias keys"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, 256]), "allowed_token_ids"), (dict(bad_words=[[1, -1]]), "bad_words"),
    (dict(bad_words=[[]]), "bad_words"), (dict(bad_words=[[999]]), "bad_words"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens=20 exceeds max_tokens=10"),
    (dict(allowed_token_ids=[4, 5], bad_words=[[5], [4]]), "ban every one of allowed_token_ids"),
]


def test_bad_controls_are_input_errors_before_anything_is_queued(qwen):
    llm = _llm(qwen, 0)
    for kw, match in BAD:
        with pytest.raises(InputError, match=match):
            llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=4), SamplingParams(**{"max_tokens": 16, **kw})])
        assert not llm.scheduler.has_unfinished(), kw
    with pytest.raises(InputError, match="bad_words strings need the checkpoint's tokenizer"):
        llm.generate([1, 2], SamplingParams(bad_words=["def"]))
    # numpy / torch values are read as Python ones
    np = pytest.importorskip("numpy")
    sp = SamplingParams(max_tokens=4, repetition_penalty=np.float32(1.5), min_tokens=torch.tensor(2),
                        allowed_token_ids=np.arange(10, 20), logit_bias={np.int64(3): torch.tensor(1.0)})
    assert llm.generate([1, 2], sp)[0].token_ids


def test_bad_word_strings_are_encoded_by_the_tokenizer():
    """bad_words strings (LLM with a tokenizer): the string's encoding and that after a space
    are banned sequences; the output never holds them."""
    llm = LLM("tiny-qwen3-next", dtype="float32", num_spec=3, max_model_len=64)
    words = ["string", "the"]
    enc = llm._encode_bad_words(SamplingParams(bad_words=words + [[7]])).bad_words
    tok = llm.tokenizer
    assert enc[-1] == [7] and all(tok.encode(w, add_special_tokens=False).ids in enc for w in words)
    assert tok.encode(" the", add_special_tokens=False).ids in enc
    plain = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=24))[0]
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=24, bad_words=words))[0]
    assert "string" in plain.text and out.token_ids != plain.token_ids
    ids = out.token_ids
    assert not any(ids[i:i + len(w)] == w for w in enc for i in range(len(ids)))


def test_generation_config_and_cli_flags(tmp_path, monkeypatch, capsys):
    """generation_config.json's repetition_penalty (greedy too), min_p and bad_words_ids become
    the defaults; the CLI's flags override them and reach SamplingParams."""
    import mtpkit
    from mtpkit import cli
    from mtpkit.checkpoint.hub import ASSETS

    d = tmp_path / "ckpt"
    d.mkdir()
    for p in (ASSETS / "tiny-qwen3-next").iterdir():
        if p.name not in ("README.md", "generation_config.json"):
            (d / p.name).symlink_to(p)
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 256, "do_sample": False, "repetition_penalty": 1.25, "min_p": 0.05, "bad_words_ids": [[9, 10]]}))
    llm = LLM(str(d), max_model_len=64)
    req = llm.add_request("x")
    assert (req.params.temperature, req.params.repetition_penalty, req.params.bad_words) == (0.0, 1.25, [[9, 10]])
    llm.abort(req.req_id)
    seen = []
    real = LLM

    class Spy(real):
        def stream(self, prompts, params, **kw):
            seen.append(params)
            return super().stream(prompts, params, **kw)
    monkeypatch.setattr(mtpkit, "LLM", Spy)
    assert cli.main(["generate", "x", "--model", str(d), "--max-tokens", "3", "--num-spec", "0"]) == 0
    assert cli.main(["generate", "x", "--model", str(d), "--max-tokens", "3", "--num-spec", "0",
                     "--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
                     "--min-p", "0.2"]) == 0
    got = [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p) for p in seen]
    assert got == [(1.25, 0.0, 0.0, 0.0), (1.5, 0.5, -0.5, 0.2)]   # min_p: the file's applies only when sampling
    assert cli.main(["generate", "x", "--model", str(d), "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty=0.0 must be" in capsys.readouterr().err
