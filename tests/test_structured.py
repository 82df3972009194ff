"""Structured outputs under speculation (issue 28): every constrained output is valid (JSON
against its schema, regex full match, choice membership), greedy and sampled, num_spec 0 / 1 /
3 / 6, both families, batched with unconstrained requests (which stay as they were); greedy
and seeded constrained outputs with drafts equal those without, token for token (float64);
the mask at each bundle position is the one llguidance's own matcher gives after feeding the
preceding tokens one by one (a property test with rejections at every position), and rollback
leaves the matcher as if the rejected tokens never came; forced-token schemas, a regex that
forbids the drafter's favourite token, bad specs refused before anything is queued, an abort
mid-structure, preemption, stop strings, max_tokens, logprobs, streaming, chat, the CLI and
serve_batch.py."""

import importlib.util
import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import jsonschema
import llguidance
import oracle
import pytest
import spec_models
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpkit import LLM, InputError, SamplingParams, StructuredOutputs
from mtpkit.checkpoint.hub import resolve_model
from mtpkit.sampling.bitmask import allowed_tokens, apply_token_bitmask_
from mtpkit.structured.compiler import GrammarCompiler
from mtpkit.structured.matcher import allowed
from mtpkit.structured.tokenizer_view import grammar_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICE = ["yes", "no", "maybe"]
PROMPTS = ["The user is", "def f(x):", "Hello"]
FAMILIES = ["tiny-qwen3-next", "tiny-gemma4"]
NUM_SPECS = [0, 1, 3, 6]


def _specs():
    return {"json": StructuredOutputs(json=SCHEMA, disable_any_whitespace=True),
            "regex": StructuredOutputs(regex=REGEX),
            "choice": StructuredOutputs(choice=CHOICE)}


def _check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICE, text


def _batch(temperature: float):
    """(prompts, params, kinds): every kind on every prompt, then two unconstrained rows."""
    prompts, params, kinds = [], [], []
    for kind, spec in _specs().items():
        for i, p in enumerate(PROMPTS):
            prompts.append(p)
            kinds.append(kind)
            params.append(SamplingParams(max_tokens=64, temperature=temperature, seed=11 + i, structured_outputs=spec))
    plain = [SamplingParams(max_tokens=24, temperature=temperature, seed=5), SamplingParams(max_tokens=24)]
    return prompts + PROMPTS[:2], params + plain, kinds + [None, None]


# One LLM per (family, num_spec), float64 so that drafts or no drafts compute the same logits
# (eager: the traced path is covered below with the random config).
_LLMS: dict = {}


def _llm(name: str, num_spec: int) -> LLM:
    if (name, num_spec) not in _LLMS:
        _LLMS[name, num_spec] = LLM(name, num_spec=num_spec, dtype="float64", enforce_eager=True)
    return _LLMS[name, num_spec]


@pytest.fixture(scope="module")
def reference():
    """The num_spec 0 outputs of each family, greedy and sampled; the unconstrained rows alone."""
    out = {}
    for name in FAMILIES:
        llm = _llm(name, 0)
        for t in (0.0, 1.0):
            prompts, params, _ = _batch(t)
            out[name, t] = [o.token_ids for o in llm.generate(prompts, params)]
            out[name, t, "alone"] = [o.token_ids for o in llm.generate(prompts[-2:], params[-2:])]
    yield out
    _LLMS.clear()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("num_spec", NUM_SPECS)
def test_every_output_is_valid_and_drafts_change_nothing(reference, name, num_spec):
    llm = _llm(name, num_spec)
    for t in (0.0, 1.0):
        prompts, params, kinds = _batch(t)
        outs = llm.generate(prompts, params)
        for o, kind in zip(outs, kinds):
            if kind is not None:
                assert o.finish_reason == "stop", (kind, o.text, o.finish_reason)
                _check_valid(kind, o.text)
        # losslessness: token for token the num_spec 0 run, constrained and unconstrained rows
        assert [o.token_ids for o in outs] == reference[name, t], (name, num_spec, t)
        # the unconstrained rows are those of a run without the constrained ones
        assert [o.token_ids for o in outs[-2:]] == reference[name, t, "alone"]
        if num_spec:
            assert sum(o.num_accepted_tokens for o in outs) > 0


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """A random Qwen3-Next config over the embedded byte vocabulary (257 tokens, eos 256, its
    tokenizer.json) whose MTP head is a bigram model: a mix of accepted and rejected drafts."""
    cfg = dict(oracle.TINY_CONFIGS["base"], vocab_size=257, eos_token_id=256)
    path = spec_models.build_spec_checkpoint(tmp_path_factory.mktemp("so") / "base", cfg, seed=3, mode="bigram",
                                             eps=0.5)
    shutil.copy(resolve_model("tiny-qwen3-next") / "tokenizer.json", path / "tokenizer.json")
    return path


def test_lossless_on_a_random_float64_config(random_checkpoint):
    """Greedy and seeded constrained outputs with drafts (traced steps, num_spec 3) equal those
    without, token for token, with rejections inside the structures."""
    specs = list(_specs().values()) + [StructuredOutputs(json_object=True, disable_any_whitespace=True)]
    params = [SamplingParams(max_tokens=40, temperature=t, seed=7 + i, structured_outputs=s)
              for t in (0.0, 0.8) for i, s in enumerate(specs)]
    prompts = [[40 + 3 * i, 70 + i, 101] for i in range(len(params))]
    base = LLM(random_checkpoint, dtype="float64", num_spec=0).generate(prompts, params)
    spec = LLM(random_checkpoint, dtype="float64", num_spec=3).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    stats = [o.spec_stats for o in spec]
    assert sum(s.num_accepted for s in stats) > 0 and sum(s.num_drafted - s.num_accepted for s in stats) > 0
    for o, kind in zip(spec, ["json", "regex", "choice", "object"] * 2):
        if o.finish_reason == "stop" and kind != "object":
            _check_valid(kind, o.text)


# ---- the masks against llguidance's own matcher ----------------------------------------

@pytest.fixture(scope="module")
def compiler():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(resolve_model("tiny-qwen3-next") / "tokenizer.json"))
    return GrammarCompiler(grammar_tokenizer(tok, 257, [256]))


def _fresh_mask(compiler, spec, tokens: list[int]) -> torch.Tensor:
    """The mask llguidance's matcher gives after consuming `tokens` one by one."""
    m = llguidance.LLMatcher(compiler.tokenizer, compiler.compile(spec), log_level=0)
    for t in tokens:
        assert m.consume_token(t)
    out = torch.zeros(9, dtype=torch.int32)
    m.unsafe_compute_mask_ptr(out.data_ptr(), 36)
    return out


def _valid_run(compiler, spec, choices: list[int], n: int) -> list[int]:
    """n tokens the grammar allows one after another (choices pick among the allowed ones)."""
    m = llguidance.LLMatcher(compiler.tokenizer, compiler.compile(spec), log_level=0)
    run = []
    for c in choices[:n]:
        bits = m.compute_bitmask()
        ok = [t for t in range(256) if bits[t >> 3] >> (t & 7) & 1]
        if not ok or m.is_stopped():
            break
        run.append(ok[c % len(ok)])
        m.consume_token(run[-1])
    return run


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["json", "regex", "choice"]), choices=st.lists(st.integers(0, 10**6), min_size=24,
                                                                            max_size=24),
       prefix_len=st.integers(0, 8), k=st.integers(1, 6), bad_at=st.integers(0, 6), bad_token=st.integers(0, 256),
       accepted=st.integers(0, 6), drafting=st.booleans())
def test_bundle_masks_equal_the_matcher_fed_token_by_token(compiler, kind, choices, prefix_len, k, bad_at,
                                                           bad_token, accepted, drafting):
    spec = _specs()[kind]
    run = _valid_run(compiler, spec, choices, prefix_len + k)
    prefix, drafts = run[:prefix_len], run[prefix_len:]
    drafts = (drafts + [bad_token] * k)[:k]
    if bad_at < k:
        drafts[bad_at] = bad_token          # a draft the grammar may forbid, at any position
    g = compiler.request_grammar(spec)
    assert g.sync(prefix) is None
    out = torch.full((k + 1, 9), -1, dtype=torch.int32)
    rewritten = list(drafts)
    limit = g.bundle_masks(rewritten, k, out, drafting)
    # the split (cheap plan before the step, masks in the worker) gives what the masks-first
    # walk gives: the same limit, rewritten drafts and rows
    ref_g, ref_out, ref_drafts = compiler.request_grammar(spec), torch.full_like(out, -1), list(drafts)
    assert ref_g.sync(prefix) is None
    assert (limit, rewritten) == (_masks_first(ref_g, ref_drafts, k, ref_out, drafting), ref_drafts)
    assert torch.equal(out, ref_out)
    # position j's mask is the state after the (possibly rewritten) drafts 0..j-1, fed one by one
    for j in range(limit + 1):
        if j and rewritten[j - 1] == 256:
            break                       # after an eos nothing is emitted (its row stays unmasked)
        assert torch.equal(out[j], _fresh_mask(compiler, spec, prefix + rewritten[:j])), j
    # the limit is the first draft the grammar forbids (after rewriting)
    for j in range(limit):
        assert allowed_tokens(out[j][None, None], 257)[0, 0, rewritten[j]]
    if limit < k and not (limit and rewritten[limit - 1] == 256):
        assert not allowed_tokens(out[limit][None, None], 257)[0, 0, rewritten[limit]]
    if not drafting:
        assert rewritten == drafts
    # rollback: the matcher is as if no draft had come ...
    assert torch.equal(_mask_now(g), _fresh_mask(compiler, spec, prefix))
    # ... and after the step's emitted tokens (a accepted drafts + the target's token) it is the
    # matcher fed those, whatever was rejected
    a = min(accepted, limit)
    if a and rewritten[a - 1] == 256:
        return
    bonus = [t for t in range(256) if allowed_tokens(out[a][None, None], 257)[0, 0, t]][:1]
    emitted = prefix + rewritten[:a] + bonus
    assert g.sync(emitted) is None
    assert torch.equal(_mask_now(g), _fresh_mask(compiler, spec, emitted))


def _masks_first(g, drafts: list[int], limit: int, out: torch.Tensor, drafting: bool) -> int:
    """The walk before the split: each position's full mask first, drafts checked against it."""
    consumed = 0
    try:
        for j in range(limit + 1):
            g.fill_mask(out[j])
            if j == limit:
                break
            if not allowed(out[j], drafts[j]):
                forced = g.forced_token() if drafting else None
                if forced is None or not allowed(out[j], forced):
                    return j
                drafts[j] = forced
            if drafts[j] in g.eos_token_ids:
                return j + 1
            if not g.matcher.consume_token(drafts[j]):
                return j
            consumed += 1
        return limit
    finally:
        if consumed:
            g.matcher.rollback(consumed)


def _mask_now(g) -> torch.Tensor:
    out = torch.zeros(9, dtype=torch.int32)
    g.fill_mask(out)
    return out


def test_bitmask_op_against_a_bit_by_bit_reference():
    torch.manual_seed(0)
    V = 70                                      # not a multiple of 32; bit 31 set in some words
    mask = torch.randint(-2**31, 2**31 - 1, (2, 3, 3), dtype=torch.int32)
    mask[0, 0, 0] = -2**31                      # only bit 31
    logits = torch.randn(4, 3, V, dtype=torch.float64)
    rows = torch.tensor([3, 1])
    want = logits.clone()
    got = apply_token_bitmask_(logits.clone(), mask, rows)
    for c, r in enumerate(rows.tolist()):
        for j in range(3):
            for t in range(V):
                if not (int(mask[c, j, t // 32]) >> (t % 32)) & 1:
                    want[r, j, t] = float("-inf")
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])    # unconstrained rows untouched
    assert allowed_tokens(mask, V)[0, 0, :32].tolist() == [t == 31 for t in range(32)]


# ---- forced tokens, the drafter's favourite token ----------------------------------------

def test_a_schema_of_forced_tokens_accepts_every_draft():
    """A const object: every token is forced. Constrained drafting (the forced tokens
    substituted for the drafter's guesses, and the drafters' own masks: each alone) makes every
    draft the forced token, so every draft is accepted; without both fewer are, and the output
    is the same."""
    so = StructuredOutputs(json={"type": "object", "properties": {"a": {"const": "hello world"}}, "required": ["a"],
                                 "additionalProperties": False}, disable_any_whitespace=True)
    llm = _llm("tiny-qwen3-next", 3)
    sp = SamplingParams(max_tokens=40, structured_outputs=so)
    on = llm.generate(PROMPTS, sp)
    assert all(o.text == '{"a":"hello world"}' and o.finish_reason == "stop" for o in on)
    assert all(o.spec_stats.num_accepted == o.spec_stats.num_drafted > 0 for o in on)
    masks = llm.runner.structured
    try:
        masks.constrained_drafting = False
        masked_only = llm.generate(PROMPTS, sp)
        masks.masked_drafting, masks.constrained_drafting = False, True
        substituted_only = llm.generate(PROMPTS, sp)
        masks.constrained_drafting = False
        off = llm.generate(PROMPTS, sp)
    finally:
        masks.constrained_drafting = masks.masked_drafting = True
    for alone in (masked_only, substituted_only):
        assert [o.token_ids for o in alone] == [o.token_ids for o in on]
        assert all(o.spec_stats.num_accepted == o.spec_stats.num_drafted > 0 for o in alone)
    assert [o.token_ids for o in off] == [o.token_ids for o in on]
    assert sum(o.spec_stats.num_accepted for o in off) < sum(o.spec_stats.num_accepted for o in on)


def test_a_regex_forbidding_the_drafters_favourite_token():
    llm = _llm("tiny-qwen3-next", 3)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    drafted = Counter(t for o in plain for t, j in zip(o.token_ids, o.token_draft_positions) if j)
    favourite = drafted.most_common(1)[0][0]
    text = llm.tokenizer.decode([favourite])
    regex = "[a-z]{4,12}(-[a-z]{4,12}){2}"
    assert not re.fullmatch("[a-z-]", text), text     # the regex forbids it everywhere
    sp = SamplingParams(max_tokens=60, structured_outputs=StructuredOutputs(regex=regex))
    llm.runner.structured.masked_drafting = False    # the drafters' own masks: test_structured_drafts.py
    try:
        outs = llm.generate(PROMPTS, sp)
    finally:
        llm.runner.structured.masked_drafting = True
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(regex, o.text), o.text
        assert favourite not in o.token_ids
        # drafts of the forbidden token were capped: fewer drafts could be accepted than proposed
        assert o.spec_stats.num_drafted < 3 * o.spec_stats.verify_steps
    assert [o.token_ids for o in outs] == [o.token_ids for o in _llm("tiny-qwen3-next", 0).generate(PROMPTS, sp)]


# ---- bad specs, abort, preemption ----------------------------------------------------------

@pytest.mark.parametrize("spec, says", [
    (StructuredOutputs(regex="[0-9"), "unclosed character class"),
    (StructuredOutputs(grammar='start: "a" b'), "unknown name"),
    (StructuredOutputs(json={"type": "integer", "minimum": 5, "maximum": 2}), "minimum (5) is greater than maximum"),
    (StructuredOutputs(), "exactly one of"),
    (StructuredOutputs(regex="a", choice=["a"]), "it sets regex, choice"),
    (StructuredOutputs(choice=[]), "non-empty list"),
    (StructuredOutputs(json="{not json"), "not JSON text"),
])
def test_bad_specs_are_refused_before_anything_is_queued(spec, says):
    llm = _llm("tiny-qwen3-next", 3)
    with pytest.raises(InputError, match=re.escape(says)):
        llm.generate(["ok prompt", "bad prompt"], [SamplingParams(), SamplingParams(structured_outputs=spec)])
    assert not llm.scheduler.waiting and not llm.scheduler.running


def test_ignore_eos_is_refused():
    with pytest.raises(InputError, match="ignore_eos=True cannot be combined with structured_outputs"):
        _llm("tiny-qwen3-next", 3).generate("x", SamplingParams(ignore_eos=True,
                                                                 structured_outputs=StructuredOutputs(regex="a+")))


def test_compiled_once_per_spec():
    llm = _llm("tiny-qwen3-next", 3)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json=dict(SCHEMA))))
    grammars = llm._grammars._grammars
    n = len(grammars)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))))
    assert len(grammars) == n                         # the same schema as text: the same grammar


def test_abort_mid_structure_frees_the_pools():
    llm = _llm("tiny-qwen3-next", 3)
    free = (llm.kv_pools.num_free, llm.slots.num_free)
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=64, structured_outputs=_specs()["json"]))
    ev = next(e for e in stream if e.new_token_ids)
    assert not ev.finished
    llm.abort([ev.output.request_id])
    rest = list(stream)
    assert any(e.finished and e.output.finish_reason == "abort" for e in rest)
    assert (llm.kv_pools.num_free, llm.slots.num_free) == free


def test_preempted_requests_keep_their_grammar():
    """Few KV blocks: requests are preempted and recomputed mid-structure; their matchers follow
    the kept outputs, so the outputs are valid and those of a run without preemption."""
    sp = [SamplingParams(max_tokens=48, temperature=t, seed=3, structured_outputs=_specs()["json"]) for t in (0, 1)]
    prompts = [p * 6 for p in PROMPTS] * 2
    params = [sp[0]] * 3 + [sp[1]] * 3
    small = LLM("tiny-qwen3-next", num_spec=3, dtype="float64", enforce_eager=True, block_size=16, num_blocks=12,
                max_model_len=128)
    outs = small.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    for o in outs:
        _check_valid("json", o.text)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _llm("tiny-qwen3-next", 0).generate(prompts, params)]


# ---- finishing, logprobs, streaming, chat ----------------------------------------------------

def test_max_tokens_mid_structure_is_length_and_stop_strings_still_cut():
    llm = _llm("tiny-gemma4", 3)
    short = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, structured_outputs=_specs()["json"]))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 5
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=64, structured_outputs=_specs()["json"]))[0]
    assert full.token_ids[-1] in llm.eos_token_ids and full.finish_reason == "stop"   # eos once complete
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=64, stop=['"age"'],
                                                  structured_outputs=_specs()["json"]))[0]
    assert cut.finish_reason == "stop" and full.text.startswith(cut.text) and '"age"' in full.text
    assert len(cut.text) < len(full.text)


def test_processed_logprobs_reflect_the_mask():
    llm = _llm("tiny-qwen3-next", 3)
    so = StructuredOutputs(choice=["yes", "no"])
    proc, raw = (llm.generate("Is it?", SamplingParams(max_tokens=8, logprobs=4, logprobs_mode=m,
                                                          structured_outputs=so))[0] for m in ("processed", "raw"))
    assert proc.token_ids == raw.token_ids
    first = proc.logprobs[0]
    allowed = {llm.tokenizer.token_to_id("y"), llm.tokenizer.token_to_id("n")}
    assert {t for t, lp in first.items() if lp.logprob > float("-inf")} == allowed
    assert abs(sum(math.exp(lp.logprob) for t, lp in first.items() if t in allowed) - 1) < 1e-9
    assert any(t not in allowed for t in raw.logprobs[0])         # raw: the model's own top tokens


def test_streaming_and_chat():
    llm = _llm("tiny-gemma4", 3)
    sp = SamplingParams(max_tokens=64, structured_outputs=_specs()["json"])
    text = "".join(ev.delta for ev in llm.stream(PROMPTS[1], sp))
    assert text == llm.generate(PROMPTS[1], sp)[0].text
    _check_valid("json", text)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    out = llm.chat([{"role": "user", "content": "Who are you?"}], sp, chat_template=template)[0]
    _check_valid("json", out.text)


# ---- the CLI and serve_batch.py --------------------------------------------------------------

def test_cli_flags(tmp_path, capsys):
    from mtpkit.cli import main
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    for flags, kind in ((["--json-schema", str(tmp_path / "s.json")], "json"), (["--regex", REGEX], "regex"),
                        (["--choice", *CHOICE], "choice")):
        assert main(["generate", "Hello", "--no-stream", "--max-tokens", "64", "--dtype", "float64", *flags]) == 0
        printed = capsys.readouterr().out.split("\n\n---")[0]
        _check_valid(kind, printed)
    assert main(["generate", "Hello", "--regex", "[0-9"]) == 2
    assert "cannot be compiled" in capsys.readouterr().err


def test_serve_batch_structured_lines(tmp_path):
    spec = importlib.util.spec_from_file_location("serve_batch", ROOT / "examples" / "serve_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = [{"prompt": "Hello", "structured": {"json": SCHEMA, "disable_any_whitespace": True}},
             {"prompt": "Hi", "structured": {"choice": CHOICE}}, {"prompt": "Hey", "structured": {"regex": REGEX}},
             {"prompt": "def f(x):"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = mod.main(["--model", "tiny-qwen3-next", "--num-spec", "3", "--max-tokens", "64", "--cpu", "--ignore-eos",
                   "--prompts", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")])
    assert rc == 0
    recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    for rec, kind in zip(recs, ["json", "choice", "regex"]):
        assert rec["finish_reason"] == "stop"
        _check_valid(kind, rec["text"])
    assert recs[3]["finish_reason"] == "length" and len(recs[3]["token_ids"]) == 64   # --ignore-eos still applies
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "structured": {"regex": "a", "choice": ["a"]}}))
    assert mod.main(["--model", "tiny-qwen3-next", "--cpu", "--prompts", str(tmp_path / "bad.jsonl"),
                     "--output", str(tmp_path / "o2.jsonl")]) == 2


def test_n_samples_each_follow_the_structure():
    """n samples of one prompt share its prefill: each has its own matcher, so each is valid and
    is the sample that seed + i gives alone."""
    llm = _llm("tiny-qwen3-next", 3)
    so = _specs()["json"]
    [out] = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=64,
                                                    structured_outputs=so))
    assert len(out.outputs) == 3
    for i, c in enumerate(out.outputs):
        _check_valid("json", c.text)
        alone = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=21 + i, max_tokens=64,
                                                        structured_outputs=so))[0]
        assert c.token_ids == alone.token_ids


@pytest.mark.parametrize("grammar", ['start: "(" NUM ("," NUM)~0..3 ")"\nNUM: /[0-9]{1,3}/',      # Lark
                                     'root ::= "(" num ("," num)? ("," num)? ")"\nnum ::= [0-9] [0-9]?'])  # GBNF
def test_grammars_lark_and_gbnf(grammar):
    sp = [SamplingParams(max_tokens=40, temperature=t, seed=2, structured_outputs=StructuredOutputs(grammar=grammar))
          for t in (0.0, 1.0)]
    outs = _llm("tiny-qwen3-next", 3).generate(PROMPTS[:2] * 2, [sp[0], sp[0], sp[1], sp[1]])
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", o.text), o.text
    assert [o.token_ids for o in outs] == [o.token_ids for o in _llm("tiny-qwen3-next", 0).generate(
        PROMPTS[:2] * 2, [sp[0], sp[0], sp[1], sp[1]])]


def test_with_the_generation_controls():
    """The grammar's masks come after the controls: a penalty and a bad word inside a structure,
    greedy and seeded, valid and the same with and without drafts."""
    sp = [SamplingParams(max_tokens=64, temperature=t, seed=4, repetition_penalty=1.3, bad_words=["0"],
                         structured_outputs=_specs()["json"]) for t in (0.0, 1.0)]
    outs = _llm("tiny-gemma4", 3).generate(PROMPTS[:2] * 2, [sp[0], sp[0], sp[1], sp[1]])
    for o in outs:
        assert o.finish_reason == "stop" and "0" not in o.text, o.text
        _check_valid("json", o.text)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _llm("tiny-gemma4", 0).generate(
        PROMPTS[:2] * 2, [sp[0], sp[0], sp[1], sp[1]])]
