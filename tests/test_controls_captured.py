"""The generation controls inside the captured step (graphs/captured.py's controls[n], the CPU
trace of sampling/controls.apply_controls) give the tokens of enforce_eager with every control
on (greedy and seeded rows, num_spec 0 and 3, both families, float64); and the controls'
dead ends: what bans every token at the first position is an InputError before queueing,
what only the tokens reach ends that request with an error (the tokens before it kept, the
same with drafts as without), the other rows going on; and a steady step's controls launch the
same tensor ops whatever the rows and the vocabulary (host work O(num_reqs)).
"""

import dataclasses
import json

import gemma4_oracle as G
import oracle
import pytest
import spec_models
import torch

from mtpkit import LLM, InputError, SamplingParams, StructuredOutputs
from mtpkit.engine.runner import ModelRunner

F64 = dict(dtype="float64", device="cpu", max_model_len=64)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = spec_models.build_spec_checkpoint(tmp_path_factory.mktemp("cap") / "qwen",
                                             dict(oracle.TINY_CONFIGS["base"]), seed=1, mode="bigram", eps=0.3)
    return dict(path=path, vocab=oracle.TINY_CONFIGS["base"]["vocab_size"], kw={})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("cap") / "gemma"
    G.save(G.build_hf("dense", seed=3), path)
    return dict(path=path, vocab=G.CONFIGS["dense"]["vocab_size"], kw=dict(draft_model=path))


def _llm(m, k, **kw):
    return LLM(m["path"], num_spec=k, **F64, **(m["kw"] if k else {}), **kw)


def _all_on(vocab: int, **kw) -> SamplingParams:
    """Every control at once (min_p applies to sampled rows)."""
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                          frequency_penalty=0.6, logit_bias={3: 2.0, 5: -4.0, 7: 1.5},
                          allowed_token_ids=list(range(0, vocab, 2)) + [1, 3], bad_words=[[8, 10], [12]],
                          min_tokens=4, stop_token_ids=[6, 14], **kw)


def _cases(vocab: int) -> list[SamplingParams]:
    plain = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [_all_on(vocab), _all_on(vocab, temperature=0.8, seed=3, min_p=0.05),
            SamplingParams(**plain),                                              # no control
            SamplingParams(**plain, frequency_penalty=1.5, temperature=0.7, seed=4),
            SamplingParams(**plain, temperature=0.9, seed=5),                      # no control, sampled
            _all_on(vocab, temperature=1.1, seed=6, top_k=30)]


@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_captured_controls_equal_enforce_eager(request, name):
    """Every control on, greedy and seeded rows and rows without controls in one batch: the
    captured path (verify, controls and propose traced from the first step, padded rows) gives
    enforce_eager's tokens, with num_spec 0 and 3; and the controls graph did run."""
    m = request.getfixturevalue(name)
    prompts = oracle.random_prompts(6, m["vocab"], seed=7, lengths=[5, 9, 3, 7, 4, 6])
    cases = _cases(m["vocab"])
    for k in (0, 3):
        eager = [o.token_ids for o in _llm(m, k, enforce_eager=True).generate(prompts, cases)]
        llm = _llm(m, k, max_num_seqs=8, graph_sizes=[8])   # 6 rows (fewer as they stop) padded to one graph of 8
        llm.runner.graphs.trace_after = 0
        got = [o.token_ids for o in llm.generate(prompts, cases)]
        assert got == eager, f"{name} num_spec={k}"
        assert llm.runner.graphs.control_graphs, "the controls were meant to replay a trace"
        assert llm.runner.control_tables._free == list(range(8, 0, -1)) or \
            sorted(llm.runner.control_tables._free) == list(range(1, 9)), "every slot is given back"
        if k:
            assert 0 < llm.stats.num_accepted < llm.stats.num_drafted


# ---- dead ends ------------------------------------------------------------------------------

def test_first_position_dead_ends_are_input_errors(qwen):
    """allowed_token_ids all banned at the first output position (one-token bad words; with
    min_tokens, the stop ids and eos too), and a logit_bias outside OpenAI's [-100, 100] (-inf,
    or past fp32's range): InputErrors naming the conflict, nothing queued."""
    llm = _llm(qwen, 0)
    eos = list(llm.eos_token_ids)
    bad = [(dict(allowed_token_ids=[4, 5], bad_words=[[5], [4]]), "bad_words ban every one of allowed_token_ids"),
           (dict(allowed_token_ids=[4, 5], stop_token_ids=[4], bad_words=[[5]], min_tokens=2),
            "min_tokens=2 bans the stop ids"),
           (dict(allowed_token_ids=[4, 5], stop_token_ids=[4, 5], min_tokens=1), "min_tokens=1 bans the stop ids"),
           (dict(logit_bias={3: float("-inf")}), r"logit_bias values \[-inf\]"),
           (dict(logit_bias={3: -1e39}), "in \\[-100, 100\\]"), (dict(logit_bias={3: 101.0}), "OpenAI's range")]
    if eos:
        bad.append((dict(allowed_token_ids=eos, min_tokens=1), "allow a token that is not a stop id"))
    for kw, match in bad:
        with pytest.raises(InputError, match=match):
            llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=8, **kw)])
        assert not llm.scheduler.has_unfinished(), kw
    # not refused: the stop ids are allowed once min_tokens is reached, or eos is no stop id
    ok = [dict(allowed_token_ids=[4, 5], stop_token_ids=[4, 5]), dict(allowed_token_ids=[4, 5], bad_words=[[4]])]
    if eos:
        ok.append(dict(allowed_token_ids=eos, min_tokens=1, ignore_eos=True))
    for kw in ok:
        assert llm.generate([1, 2], SamplingParams(max_tokens=2, **kw))[0].finish_reason in ("stop", "length")


def test_bad_words_dead_end_inside_a_bundle(qwen, monkeypatch):
    """Bad words of four tokens that ban every allowed token after the output's first three:
    the request emits those three, then ends with an error naming the controls, with drafts
    (where the dead end is reached inside a verify bundle, after accepted drafts) as without;
    the other rows of the batch go on as if the dead rows were not there."""
    prompts = oracle.random_prompts(5, qwen["vocab"], seed=12, lengths=[6, 8, 5, 7, 9])
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    dead = []
    for o in (x.token_ids for x in _llm(qwen, 0).generate(prompts[:3], plain)):
        allowed = sorted(set(o[:4]) | {o[0] + 1})
        dead.append(SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed,
                                   bad_words=[o[:3] + [t] for t in allowed]))
        dead[-1].expected = o[:3]
    others = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=2)]
    seen = {0: [], 3: []}
    real = ModelRunner._dead_ends
    k = 0

    def spy(live, emitted):
        d = real(live, emitted)
        seen[k].extend(d.values())
        return d
    monkeypatch.setattr(ModelRunner, "_dead_ends", staticmethod(spy))
    for k in (0, 3):
        llm = _llm(qwen, k, max_num_seqs=8)
        outs = llm.generate(prompts, dead + others)
        for sp, r in zip(dead, outs):
            assert r.token_ids == sp.expected and r.finish_reason == "error", (k, r.token_ids, r.error)
            assert "no token that may be generated" in r.error and "allowed_token_ids, bad_words" in r.error
        alone = llm.generate(prompts[3:], others)
        assert [x.token_ids for x in outs[3:]] == [x.token_ids for x in alone], f"num_spec={k}: other rows"
        assert all(x.finish_reason == "length" for x in outs[3:])
    assert seen[0] == [0, 0, 0] and max(seen[3]) >= 1, ("the dead end was meant to be reached inside a bundle "
                                                         f"(after an accepted draft): {seen}")


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-qwen3-next", dtype="float32", num_spec=3, max_model_len=64)


def test_grammar_dead_ends_end_the_request(tiny):
    """Run-time dead ends with a grammar: a regex of digits with allowed_token_ids that hold no
    digit (at the first token: the prefill's), and a complete structure (only eos left) while
    min_tokens still bans eos (inside decoding). Each ends its request with an error naming
    the controls and the grammar; a row without them goes on."""
    vocab = tiny.model_config.vocab_size
    tok = tiny.tokenizer
    digits = {i for i in range(vocab) if (s := tok.decode([i])) and s.strip().isdigit()}
    letters = [i for i in range(vocab) if i not in digits and i not in tiny.eos_token_ids][:50]
    no_digit = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="[0-9]+"),
                              allowed_token_ids=letters)
    short = SamplingParams(max_tokens=12, structured_outputs=StructuredOutputs(choice=["yes"]), min_tokens=8)
    free = SamplingParams(max_tokens=6)
    outs = tiny.generate(["x = ", "Answer:", "def f():"], [no_digit, short, free])
    a, b, c = outs
    assert a.finish_reason == "error" and a.token_ids == [] and "allowed_token_ids, structured_outputs" in a.error
    assert b.finish_reason == "error" and "min_tokens, structured_outputs" in b.error
    assert 0 < len(b.token_ids) < 8 and tok.decode(b.token_ids) == "yes"
    assert c.finish_reason == "length" and c.token_ids == tiny.generate("def f():", free)[0].token_ids
    json.dumps(a.error)   # a plain message (the server returns it)


def test_controls_tensors_are_typed_and_rows_without_controls_untouched():
    """apply_controls on a hand-made table: an inactive row comes out as its input (upcast),
    exactly; an active row with neutral values too."""
    from mtpkit.sampling.controls import ControlTables, apply_controls

    t = ControlTables(3, 11, torch.float32, "cpu")
    x = torch.randn(2, 2, 11, dtype=torch.bfloat16)
    drafts = torch.tensor([[4], [9]])
    ints = torch.tensor([[0, 1], [0, 1], [0, 0]])                 # slot, active, min_left per row
    floats = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])    # repetition, presence, frequency
    out = apply_controls(x, drafts, ints, floats, *t.tensors())
    assert out.dtype == torch.float32 and torch.equal(out, x.float())


@dataclasses.dataclass
class _Req:
    """What the controls read of a request (sampling/controls.ControlledRequest)."""

    params: SamplingParams
    prompt_token_ids: list
    output_token_ids: list
    eos_token_ids: tuple = (1,)
    drafts: list = dataclasses.field(default_factory=list)
    controls: object = None


def test_a_steady_step_launches_the_same_ops_whatever_the_rows_and_vocabulary():
    """Host work per step is O(num_reqs): after their slots are built, a step's controls
    (prepare, apply_controls, the multi-token bad words) launch the same tensor ops for 2 rows
    as for 6, and for a vocabulary of 50 as of 5000; nothing loops over the vocabulary."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mtpkit.sampling.controls import ControlTables, controlled_logits

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def ops(rows: int, vocab: int) -> int:
        sp = SamplingParams(max_tokens=20, repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={5: 1.0},
                            allowed_token_ids=list(range(0, vocab, 2)), bad_words=[[6, 8], [10]], min_tokens=9)
        reqs = [_Req(sp, [7, 8, 9], [6, 4], drafts=[2, 3, 4]) for _ in range(rows)]
        tables = ControlTables(rows + 1, vocab, torch.float64, "cpu")
        logits = torch.randn(rows, 4, vocab, dtype=torch.float64)
        drafts = torch.tensor([r.drafts for r in reqs])
        controlled_logits(logits, drafts, reqs, tables)              # builds the slots
        for r in reqs:
            r.output_token_ids += [12, 6]                              # a step emitted two tokens each
        Count.n = 0
        with Count():
            controlled_logits(logits, drafts, reqs, tables)
        return Count.n

    counts = {(rows, vocab): ops(rows, vocab) for rows in (2, 6) for vocab in (50, 5000)}
    assert len(set(counts.values())) == 1, counts


def test_counts_add_every_new_output_token_once():
    """ControlTables.prepare counts each penalised row's output tokens since its last step into its
    slot's counts (on CPU through numpy: a step's few tokens one by one, a long run, as after a
    preemption, at once), repeated tokens included, and a row's first prepare counts its output."""
    from mtpkit.sampling.controls import ControlTables

    vocab = 40
    g = torch.Generator().manual_seed(4)
    sp = SamplingParams(max_tokens=500, frequency_penalty=0.5)
    reqs = [_Req(sp, [3, 4], torch.randint(0, vocab, (n,), generator=g).tolist()) for n in (100, 2)]
    tables = ControlTables(3, vocab, torch.float32, "cpu")
    for step in range(4):
        tables.prepare(reqs)
        for r in reqs:
            want = torch.bincount(torch.tensor(r.output_token_ids), minlength=vocab).float()
            assert torch.equal(tables.counts[r.controls.slot], want), step
            r.output_token_ids += [7, 7, 9] if step % 2 else [11]   # a step's new tokens, one repeated
