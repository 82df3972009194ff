"""Constrained drafting (issue 28): the drafters mask their own logits with the grammar state
after the step's emitted tokens and the drafts before each pass (structured/draft_masks.py).

For the three drafters (Qwen3-Next's MTP head, a classic draft model, the Gemma 4 assistant),
float64, CPU graphs traced from the first step (so unconstrained steps replay the captured
proposal and constrained ones call it eagerly): every draft of a constrained row is a token
llguidance's own matcher, fed the outputs, the emitted tokens and the earlier drafts one by
one, allows; greedy constrained output with drafts equals num_spec=0's, with masked drafting
on and off; on a regex that forbids the drafter's favourite token (several allowed) more
drafts are accepted with the masks than without. A planted fault (each pass masked with the
previous pass's state) is caught by the same check. Steps without constrained rows spend
nothing on draft masks; with CPU graphs every step replays the traced proposal and only a step
whose constrained row drafted a forbidden token runs it again with the masks.
"""

import re
from collections import Counter

import llguidance
import pytest

from mtpkit import LLM, SamplingParams, StructuredOutputs
from mtpkit.checkpoint.hub import resolve_model
from mtpkit.structured import draft_masks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = "[a-z]{4,12}(-[a-z]{4,12}){2}"          # never the drafters' favourite (a space)
PROMPTS = ["The user is", "def f(x):", "Hello"]
DRAFTERS = {"mtp": ("tiny-qwen3-next", {}), "assistant": ("tiny-gemma4", {}),
            "draft model": ("tiny-gemma4", {"draft_model": "tiny-gemma4"})}   # the target drafts for itself


def _params(max_tokens=48):
    json_spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    return ([SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputs(regex=REGEX))] * 3
            + [SamplingParams(max_tokens=max_tokens, structured_outputs=json_spec)] * 2
            + [SamplingParams(max_tokens=16)])           # an unconstrained row in the same steps


PROMPTS6 = PROMPTS + PROMPTS[:2] + ["x"]
_LLMS: dict = {}
TRACE_AFTER = 10**9


def _llm(name: str, num_spec: int, **kw) -> LLM:
    key = (name, num_spec, tuple(sorted(kw.items())))
    if key not in _LLMS:
        kw = {k: resolve_model(v) for k, v in kw.items()}
        llm = _LLMS[key] = LLM(name, num_spec=num_spec, dtype="float64", max_num_seqs=8, **kw)
        if llm.runner.graphs is not None:
            llm.runner.graphs.trace_after = TRACE_AFTER
    return _LLMS[key]


@pytest.fixture(scope="module", autouse=True)
def _close_llms():
    yield
    for llm in _LLMS.values():
        llm.close()
    _LLMS.clear()


class StepSpy:
    """Records every step's (grammar spec, outputs before the step, emitted tokens, drafts) of
    the constrained requests, from the runner's own results."""

    def __init__(self, llm: LLM):
        self.llm, self.steps = llm, []
        self.execute = llm.runner.execute

    def __enter__(self):
        def spy(plan):
            before = [list(r.output_token_ids) for r in plan.reqs]
            results = self.execute(plan)
            for r, out, res in zip(plan.reqs, before, results):
                if r.grammar is not None and res.emitted:
                    self.steps.append((r.params.structured_outputs, out, list(res.emitted), list(res.drafts)))
            return results
        self.llm.runner.execute = spy
        return self

    def __exit__(self, *exc):
        self.llm.runner.execute = self.execute


def forbidden_drafts(llm: LLM, steps) -> list:
    """The drafts llguidance's matcher refuses, fed the outputs, the emitted tokens and the
    drafts before it one by one (eos: allowed once the structure is complete, then nothing)."""
    compiler, eos = llm._grammars, set(llm.eos_token_ids)
    bad = []
    for spec, out, emitted, drafts in steps:
        if eos & set(emitted):
            continue                                   # the request ends in this step
        m = llguidance.LLMatcher(compiler.tokenizer, compiler.compile(spec), log_level=0)
        assert m.consume_tokens(out + emitted), m.get_error()
        for j, d in enumerate(drafts):
            ok = m.is_accepting() if d in eos else m.validate_tokens([d]) == 1
            if not ok:
                bad.append((out + emitted, j, d))
                break
            if d in eos:
                break
            assert m.consume_token(d)
    return bad


def _accepted(outs) -> int:
    return sum(o.spec_stats.num_accepted for o in outs if o.spec_stats is not None)


@pytest.fixture(scope="module")
def references():
    return {name: [o.token_ids for o in _llm(name, 0).generate(PROMPTS6, _params())]
            for name in ("tiny-qwen3-next", "tiny-gemma4")}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_drafts_are_valid_lossless_and_accepted_more(references, drafter):
    name, kw = DRAFTERS[drafter]
    llm = _llm(name, 3, **kw)
    masks = llm.runner.structured
    with StepSpy(llm) as spy:
        on = llm.generate(PROMPTS6, _params())
    assert spy.steps and not forbidden_drafts(llm, spy.steps)
    assert [o.token_ids for o in on] == references[name]
    for o in on[:3]:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    masks.masked_drafting = False
    try:
        with StepSpy(llm) as spy_off:
            off = llm.generate(PROMPTS6, _params())
    finally:
        masks.masked_drafting = True
    assert [o.token_ids for o in off] == references[name]
    # the unmasked drafters propose tokens the grammar forbids (the plan then caps or rewrites them)
    assert forbidden_drafts(llm, spy_off.steps)
    assert _accepted(on[:5]) > _accepted(off[:5]), (drafter, _accepted(on[:5]), _accepted(off[:5]))
    if drafter == "draft model":   # the target drafting for itself under the same masks: all accepted
        assert all(o.spec_stats.num_accepted == o.spec_stats.num_drafted for o in on[:5])


def test_a_regex_forbidding_the_favourite_gains_acceptance():
    """The drafter's favourite token is forbidden everywhere, several tokens are allowed (no
    forced token to substitute): with the masks the drafts follow the grammar, without them
    the steps' drafts are capped at the favourite."""
    llm = _llm("tiny-qwen3-next", 3)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    drafted = Counter(t for o in plain for t, j in zip(o.token_ids, o.token_draft_positions) if j)
    favourite = drafted.most_common(1)[0][0]
    assert not re.fullmatch("[a-z-]", llm.tokenizer.decode([favourite]))
    sp = SamplingParams(max_tokens=60, structured_outputs=StructuredOutputs(regex=REGEX))
    masks = llm.runner.structured
    masks.draft_seconds = 0.0
    on = llm.generate(PROMPTS, sp)
    assert masks.draft_seconds > 0
    masks.masked_drafting = False
    try:
        off = llm.generate(PROMPTS, sp)
    finally:
        masks.masked_drafting = True
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert _accepted(on) > _accepted(off)
    assert sum(o.spec_stats.verify_steps for o in on) < sum(o.spec_stats.verify_steps for o in off)
    # unconstrained requests: no draft masks (the captured proposal, nothing spent on the host)
    masks.draft_seconds = 0.0
    llm.generate(PROMPTS, SamplingParams(max_tokens=8))
    assert masks.draft_seconds == 0.0


def test_a_mask_of_the_wrong_pass_is_caught(monkeypatch):
    """Planted fault: pass j masked with the state before draft j - 1 (the previous pass's);
    the drafts it gives are refused by the matcher fed token by token."""
    llm = _llm("tiny-qwen3-next", 3)
    real = draft_masks.ProposalMasks.__call__

    def lagging(self, j, previous):
        mask = real(self, j, previous)                  # the matcher after draft j - 1, as it must be
        lag = mask if j == 0 else self.lag              # ... but pass j gets pass j - 1's mask
        self.lag = mask
        return lag

    monkeypatch.setattr(draft_masks.ProposalMasks, "__call__", lagging)
    with StepSpy(llm) as spy:
        llm.generate(PROMPTS6, _params())
    assert forbidden_drafts(llm, spy.steps)


def test_traced_graphs_rerun_the_proposal_with_masks_only_when_a_draft_is_forbidden():
    """CPU graphs traced from the first step: every step replays the traced proposal; a step
    whose constrained row got a draft its grammar forbids runs it again, calling the propose
    body directly with the masks (they need the drafts on the host); the outputs are num_spec=0's."""
    llm = LLM("tiny-qwen3-next", num_spec=3, dtype="float64", max_num_seqs=1, graph_sizes=[1])
    llm.runner.graphs.trace_after = 0
    calls = []
    body = llm.runner.graphs.bodies.propose
    llm.runner.graphs.bodies.propose = lambda *a, **k: calls.append(a[-1]) or body(*a, **k)
    try:
        sp = SamplingParams(max_tokens=12, structured_outputs=StructuredOutputs(regex=REGEX))
        plain = SamplingParams(max_tokens=12)
        outs = [llm.generate("Hello", p)[0].token_ids for p in (plain, sp)]
        masked = [c for c in calls if isinstance(c, draft_masks.ProposalMasks)]
        # the reruns called the body with masks; without masks it was only traced (once per graph)
        assert masked and len(calls) - len(masked) == len(llm.runner.graphs.propose_graphs) > 0
        assert len(masked) == llm.runner.structured.masked_proposals
    finally:
        llm.close()
    ref = _llm("tiny-qwen3-next", 0)
    assert outs == [ref.generate("Hello", p)[0].token_ids for p in (plain, sp)]


def test_the_assistants_centroid_head_under_masks():
    """use_ordered_embeddings: the centroid head scores a few candidates, which may hold no
    allowed token, so a constrained row's draft is the masked argmax over the whole vocabulary;
    the other rows keep the centroid head's draft (the assistant's step with a stand-in head and
    no layers: only the choice of the token is under test)."""
    import types

    import torch

    from mtpkit.models.gemma4.assistant import Gemma4Assistant
    from mtpkit.parallel import TP
    from mtpkit.sampling.bitmask import DraftMask

    V, H = 40, 8
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=gen, dtype=torch.float64)
    head = types.SimpleNamespace(argmax=lambda d, e: torch.full((d.shape[0],), 3))   # always token 3
    me = types.SimpleNamespace(pre_projection=lambda x: x[:, :H], layers=[], norm=lambda x: x,
                               post_projection=lambda x: x, masked_embedding=head, embed_tokens=embed,
                               tp=TP.single(), cfg=types.SimpleNamespace(vocab_size=V))
    d = torch.randn(3, H, generator=gen, dtype=torch.float64)
    words = torch.zeros(1, 2, dtype=torch.int32)
    words[0, 0] = (1 << 5) | (1 << 7)                                             # row 1 allows 5 and 7
    mask = DraftMask(words, torch.tensor([1]))
    token, _ = Gemma4Assistant.step(me, d, d, torch.zeros(3, dtype=torch.int64), {}, None, mask)
    scores = d[1] @ embed.T
    assert token.tolist() == [3, 5 if scores[5] >= scores[7] else 7, 3]
    assert Gemma4Assistant.step(me, d, d, torch.zeros(3, dtype=torch.int64), {}, None)[0].tolist() == [3, 3, 3]
