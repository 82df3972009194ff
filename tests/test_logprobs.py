"""Logprobs and prompt logprobs (SamplingParams.logprobs / prompt_logprobs / logprobs_mode):
equal to log_softmax of transformers' logits at the same positions, with and without drafts
(accepted drafts get the target's logprobs), on the prefill path with chunked prefill, near
max_model_len, in mixed batches, in processed mode, streamed, cut with the tokens, and
without changing a single generated token."""

import math

import pytest
import torch

import oracle
import spec_models
from mtpkit import LLM, InputError, Logprob, SamplingParams
from mtpkit.checkpoint.hub import resolve_model
from mtpkit.sampling.sampler import SamplingTensors, target_probs

NAME = "tiny-qwen3-next"
PROMPT = "import os\nimport sys\n\ndef main(argv):\n    "
TOL = 1e-5   # of the logits' scale (fp32 engine against float64 transformers)
# float64 engine against its own score() (another prefill shape: the recurrent layers' chunked
# path rounds differently, seen ~1e-7 apart); a logprob taken at the wrong position is O(1) off.
F64_ATOL = 1e-6


def _ref_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1)


def _check_entry(d: dict, token: int, ref_row: torch.Tensor, n: int, atol: float, where: str):
    """d holds the token (right logprob and rank) and the true top-n with their ranks."""
    assert token in d, f"{where}: the token {token} has no entry"
    assert abs(d[token].logprob - ref_row[token].item()) <= atol, (where, d[token], ref_row[token].item())
    assert d[token].rank == 1 + int((ref_row > ref_row[token] + atol).sum()) or \
        abs(ref_row.sort(descending=True).values[d[token].rank - 1] - ref_row[token]) <= atol, (where, d[token])
    top = ref_row.topk(n)
    assert len(d) in (n, n + 1), (where, len(d), n)
    for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        if t in d:   # a near-tie may swap two neighbours
            assert abs(d[t].logprob - v) <= atol and abs(d[t].rank - r) <= 1, (where, t, d[t], v, r)
    got = sorted((lp.logprob for t, lp in d.items() if lp.rank <= n), reverse=True)
    assert len(got) == n and all(abs(a - b) <= atol for a, b in zip(got, top.values.tolist())), where


def _check_output(out, prompt: list[int], ref: torch.Tensor, n: int, pn: int | None, atol: float):
    """ref: reference logprobs [prompt + output, vocab] of the whole sequence."""
    assert len(out.logprobs) == len(out.token_ids)
    for i, t in enumerate(out.token_ids):
        _check_entry(out.logprobs[i], t, ref[len(prompt) - 1 + i], n, atol, f"output token {i}")
    if pn is not None:
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            _check_entry(out.prompt_logprobs[i], prompt[i], ref[i - 1], pn, atol, f"prompt token {i}")


@pytest.fixture(scope="module")
def embedded():
    hf = oracle.load_hf_model(resolve_model(NAME), dtype=torch.float64)
    llm = LLM(NAME, dtype="float32")
    return hf, llm.tokenizer.encode(PROMPT).ids


@pytest.mark.parametrize("num_spec,chunk", [(0, 2048), (3, 2048), (3, 5)])
def test_logprobs_equal_transformers_on_embedded_model(embedded, num_spec, chunk):
    """Oracle: every generated and prompt token's logprob (and the top-N) is log_softmax of
    transformers' logits there; with drafts (accepted drafts included: the target's, not the
    drafter's) and with prompts prefilled in chunks of 5 tokens."""
    hf, ids = embedded
    llm = LLM(NAME, dtype="float32", num_spec=num_spec, max_num_batched_tokens=chunk)
    out = llm.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=4, prompt_logprobs=3))[0]
    logits = oracle.hf_logits(hf, ids + out.token_ids)
    if num_spec:
        assert out.num_accepted_tokens > 0, "no draft was accepted: the test would not see the drafts' logprobs"
    _check_output(out, ids, _ref_logprobs(logits), 4, 3, TOL * logits.abs().max().item())
    assert all(isinstance(lp, Logprob) and lp.decoded_token == llm.tokenizer.decode([t])
               for d in out.logprobs for t, lp in d.items())


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """A float32 random Qwen3-Next config whose MTP head is accepted often (a bigram model)."""
    path = spec_models.build_spec_checkpoint(tmp_path_factory.mktemp("lp") / "base", dict(oracle.TINY_CONFIGS["base"]),
                                             seed=1, mode="bigram", eps=0.3)
    return path, oracle.load_hf_model(path, dtype=torch.float64)


@pytest.mark.parametrize("num_spec", [0, 3])
def test_logprobs_equal_transformers_on_random_config(random_checkpoint, num_spec):
    path, hf = random_checkpoint
    vocab = oracle.TINY_CONFIGS["base"]["vocab_size"]
    prompts = oracle.random_prompts(3, vocab, seed=5, lengths=[9, 23, 4])
    llm = LLM(path, dtype="float32", num_spec=num_spec, max_model_len=128, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, logprobs=5, prompt_logprobs=2))
    if num_spec:
        assert sum(o.num_accepted_tokens for o in outs) > 0
    for p, o in zip(prompts, outs):
        logits = oracle.hf_logits(hf, p + o.token_ids)
        _check_output(o, p, _ref_logprobs(logits), 5, 2, TOL * logits.abs().max().item())


def test_logprobs_change_no_token_and_agree_across_num_spec():
    """Losslessness: greedy tokens with logprobs on are those with them off, for num_spec 0, 1
    and 3 (float64), and the logprobs agree across num_spec (drafts change nothing)."""
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "x = ["]
    base = None
    for k in (0, 1, 3):
        llm = LLM(NAME, dtype="float64", num_spec=k)
        off = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
        on = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2, prompt_logprobs=1))
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert all(o.logprobs is None and o.prompt_logprobs is None for o in off)
        if base is None:
            base = on
            continue
        for a, b in zip(base, on):
            assert a.token_ids == b.token_ids
            for da, db in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:]):
                assert da.keys() == db.keys()
                # 1e-6: a CPU trace replays the step ~2e-8 away from eager in float64 (seen at
                # num_spec 0 once traced; eager engines agree to 1e-14): far below a wrong position
                assert all(abs(da[t].logprob - db[t].logprob) < 1e-6 and da[t].rank == db[t].rank for t in da)


def test_logprobs_of_the_last_tokens_before_max_model_len():
    """Drafts are limited near max_model_len: the tokens there still get their own position's
    logprobs, one per token."""
    llm = LLM(NAME, dtype="float64", num_spec=3, max_model_len=40)
    ids = llm.tokenizer.encode(PROMPT).ids
    for room in (1, 2, 3, 5):
        prompt = (ids * 3)[:40 - room]
        out = llm.generate([prompt], SamplingParams(max_tokens=room, ignore_eos=True, logprobs=3))[0]
        assert len(out.token_ids) == room and out.finish_reason == "length"
        ref = _ref_logprobs(llm.score(prompt + out.token_ids))
        _check_output(out, prompt, ref, 3, None, F64_ATOL)


def test_mixed_batch_only_the_rows_that_ask():
    """A batch of greedy and sampled rows where only some ask: those get what they get alone,
    the others get None and the same tokens as without any logprobs in the batch."""
    prompts = ["def fibonacci(n):", "import os\n", "for i in range(10):", "x = [", "with open(path) as f:"]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=4, logprobs=1, prompt_logprobs=0),
              SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=4)]
    plain = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=p.temperature, seed=p.seed) for p in params]
    llm = LLM(NAME, dtype="float64", num_spec=3)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, plain)]
    for p, o, prompt in zip(params, outs, prompts):
        assert (o.logprobs is None) == (p.logprobs is None) and (o.prompt_logprobs is None) == (p.prompt_logprobs is None)
        if p.logprobs is None and p.prompt_logprobs is None:
            continue
        ids = llm.tokenizer.encode(prompt).ids
        ref = _ref_logprobs(llm.score(ids + o.token_ids))
        if p.logprobs is not None:
            assert len(o.logprobs) == len(o.token_ids)
            for i, t in enumerate(o.token_ids):
                _check_entry(o.logprobs[i], t, ref[len(ids) - 1 + i], p.logprobs, F64_ATOL, f"token {i}")
        if p.prompt_logprobs is not None:
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
            for i in range(1, len(ids)):
                _check_entry(o.prompt_logprobs[i], ids[i], ref[i - 1], p.prompt_logprobs, F64_ATOL, f"prompt {i}")


@pytest.mark.parametrize("num_spec", [0, 3])
def test_processed_mode_is_the_sampled_distribution(num_spec):
    """logprobs_mode="processed": a sampled row's logprob is log of the target distribution
    (temperature, top-k, top-p) it was drawn from; a greedy row's are its raw ones."""
    llm = LLM(NAME, dtype="float64", num_spec=num_spec)
    ids = llm.tokenizer.encode(PROMPT).ids
    sp = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.7, top_k=8, top_p=0.9, seed=11,
                        logprobs=3, logprobs_mode="processed")
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3, logprobs_mode="processed")
    out, g = llm.generate([ids, ids], [sp, greedy])
    logits = llm.score(ids + out.token_ids)[len(ids) - 1:-1]
    p = target_probs(logits[:, None, :], SamplingTensors.from_params([sp] * len(logits), "cpu"))[:, 0]
    raw = _ref_logprobs(logits)
    for i, t in enumerate(out.token_ids):
        assert abs(out.logprobs[i][t].logprob - math.log(p[i, t].item())) < 1e-5
        kept = int((p[i] > 0).sum())
        assert all(math.isinf(lp.logprob) == (lp.rank > kept) for lp in out.logprobs[i].values())
    # not the raw ones (where top-p keeps one token both are ~0)
    assert sum(abs(out.logprobs[i][t].logprob - raw[i, t].item()) > 1e-3 for i, t in enumerate(out.token_ids)) > 5
    _check_output(g, ids, _ref_logprobs(llm.score(ids + g.token_ids)), 3, None, F64_ATOL)


def test_streamed_cut_by_stop_strings_and_preemption():
    """StreamEvent.new_logprobs carries each event's tokens' logprobs; a stop string that ends
    inside an accepted bundle cuts the logprobs with the tokens; preemption (recompute)
    changes no value."""
    llm = LLM(NAME, dtype="float64", num_spec=3)
    ids = llm.tokenizer.encode(PROMPT).ids
    free = llm.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    steps = free.token_steps
    # a stop string completed by a token that is not its step's last: the step's later tokens are cut
    j = next(j for j in range(8, 39) if steps[j] == steps[j + 1] and steps[j - 1] != steps[j])
    stop = llm.tokenizer.decode(free.token_ids[j - 2:j + 1])
    sp = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2, stop=[stop])
    events = list(llm.stream([ids], sp))
    out = events[-1].output
    m = len(out.token_ids)
    assert out.finish_reason == "stop" and m < 40 and steps[m - 1] == steps[m], "the stop cut no bundle"
    streamed = [d for ev in events for d in (ev.new_logprobs or [])]
    assert [t for ev in events for t in ev.new_token_ids] == out.token_ids
    assert len(streamed) == len(out.logprobs) == len(out.token_ids)
    assert all(a is b for a, b in zip(streamed, out.logprobs))
    ref = _ref_logprobs(llm.score(ids + out.token_ids))
    _check_output(out, ids, ref, 2, None, F64_ATOL)
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):"] * 2
    sp = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    roomy = LLM(NAME, dtype="float64", num_spec=3, max_model_len=96).generate(prompts, sp)
    tight = LLM(NAME, dtype="float64", num_spec=3, max_model_len=96, num_blocks=12,
                max_num_batched_tokens=8).generate(prompts, sp)
    assert any(o.num_preemptions for o in tight)
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for da, db in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:]):
            assert da.keys() == db.keys() and all(abs(da[t].logprob - db[t].logprob) < F64_ATOL for t in da)


@pytest.mark.parametrize("bad", [dict(logprobs=-1), dict(logprobs=True), dict(logprobs=2.0), dict(logprobs="3"),
                                 dict(prompt_logprobs=-2), dict(prompt_logprobs=False), dict(logprobs=10**6),
                                 dict(prompt_logprobs=10**6), dict(logprobs_mode="processed_logits"),
                                 dict(logprobs_mode=None)])
def test_bad_values_are_refused_before_anything_is_queued(bad):
    llm = LLM(NAME, dtype="float32")
    with pytest.raises(InputError, match=next(iter(bad))):
        llm.generate(["x = [", "y"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, **bad)])
    assert not llm.scheduler.has_unfinished()
    vocab = llm.model_config.vocab_size
    assert llm.generate("x", SamplingParams(max_tokens=2, logprobs=vocab))[0].logprobs[0].keys() == set(range(vocab))


def test_gemma4_with_its_assistant():
    """The Gemma 4 family once: with the assistant drafting, the same greedy tokens as without
    and each token's logprobs are the target's (its prefill-path logits)."""
    outs = []
    for k in (0, 3):
        llm = LLM("tiny-gemma4", draft_model="tiny-gemma4-assistant" if k else None, num_spec=k, dtype="float64")
        ids = llm.tokenizer.encode("def fibonacci(n):").ids
        out = llm.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2))[0]
        if k:
            assert out.num_accepted_tokens > 0
        _check_output(out, ids, _ref_logprobs(llm.score(ids + out.token_ids)), 3, 2, F64_ATOL)
        outs.append(out)
    assert outs[0].token_ids == outs[1].token_ids
