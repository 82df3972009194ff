"""A drafter in a dtype of its own (LLM(draft_dtype=...)): the MTP head or the Gemma 4 assistant
in bfloat16 beside the target. What is generated must not change (the target verifies every
draft): greedy and seeded sampled output equal the target's without drafts, on the eager path,
the traced graphs and a compiled graph; the drafter's weights are bfloat16 and still draft well.
The targets run in float64, so separately built engines agree far below any argmax tie.
Bad values are ConfigErrors before any weight is read."""

import dataclasses
import json
import re

import pytest
import torch

from mtpkit import LLM, SamplingParams, StructuredOutputs
from mtpkit.engine import build
from mtpkit.errors import ConfigError
from mtpkit.graphs import compiled

F64 = dict(dtype="float64", device="cpu", max_model_len=128)
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):"]
PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=40, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=8, ignore_eos=True)]


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def without_drafts():
    return {name: _tokens(LLM(name, num_spec=0, **F64)) for name in ("tiny-qwen3-next", "tiny-gemma4")}


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma4"])
@pytest.mark.parametrize("path", ["eager", "traced"])
def test_bfloat16_drafter_generates_what_the_target_alone_does(name, path, without_drafts):
    llm = LLM(name, num_spec=3, draft_dtype="bfloat16", enforce_eager=path == "eager", **F64)
    if path == "traced":
        llm.runner.graphs.trace_after = 0
    assert _tokens(llm) == without_drafts[name]
    own = [p for m in llm.runner.drafter.own_modules() for p in m.parameters()]
    assert own and {p.dtype for p in own} == {torch.bfloat16}
    mine = {id(p) for p in own}
    assert {p.dtype for p in llm.runner.model.parameters() if id(p) not in mine} == {torch.float64}
    if path == "traced":
        assert llm.runner.graphs.propose_graphs, "the proposal ran outside the traced graphs"
    # a bfloat16 drafter still drafts well (the float32 / float64 one: ~3.8 and ~3.6 of 4 here)
    assert llm.stats.mean_acceptance_length > 3.0, llm.stats.mean_acceptance_length


def test_bfloat16_drafter_in_a_compiled_graph(monkeypatch, without_drafts):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")   # dynamo's capture, no C++ compile (seconds)
    llm = LLM("tiny-qwen3-next", num_spec=2, draft_dtype="bfloat16", compile="inductor", compile_after=0, **F64)
    llm.runner.graphs.trace_after = 0
    # two requests, 16 tokens: few graph keys (seconds); greedy and seeded tokens are prefix-stable
    params = [dataclasses.replace(sp, max_tokens=16) for sp in PARAMS[:2]]
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert out == [t[:16] for t in without_drafts["tiny-qwen3-next"][:2]]
    assert any(r.name.startswith("propose_") and r.error is None for r in llm.runner.graphs.compiler.records)


def test_mtp_moe_is_merged_again_in_the_drafter_dtype():
    """The MTP layer's MoE holds its router and experts' input products as one column-major
    matrix (MoE.merge_for_cpu): cast, it is one bfloat16 matrix again, not a stale float copy."""
    llm = LLM("tiny-qwen3-next", num_spec=1, draft_dtype="bfloat16")
    merged = [m for m in llm.runner.model.mtp.modules() if getattr(m, "w_in13", None) is not None]
    assert merged, "the MTP layer's MoE is merged on CPU (MoE.merge_for_cpu): nothing was checked"
    for m in merged:
        assert m.w_in13.dtype == torch.bfloat16 and m._merged()
        assert m.w_in.data_ptr() == m.w_in13.data_ptr()


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_spec=3, draft_dtype="float8"), ["draft_dtype='float8'", "bfloat16"]),
    (dict(num_spec=3, draft_dtype="float16"), ["draft_dtype='float16'", "no fast path on CPU"]),
    (dict(num_spec=0, draft_dtype="bfloat16"), ["num_spec=0 runs no drafter", "drop draft_dtype"]),
    (dict(model="tiny-gemma4", num_spec=2, draft_model="tiny-gemma4", draft_dtype="bfloat16"),   # a draft model
     ["the draft model (gemma4_text) drafter runs in the target's dtype", "drop draft_dtype"]),
])
def test_bad_draft_dtype_is_refused_before_any_weight_is_read(monkeypatch, kwargs, words):
    monkeypatch.setattr(build, "load_weights", lambda *a, **k: pytest.fail("weights were read"))
    kwargs = dict(kwargs)
    with pytest.raises(ConfigError) as e:
        LLM(kwargs.pop("model", "tiny-qwen3-next"), **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_targets_dtype_and_auto_change_nothing():
    for dt in (None, "auto", "float32", torch.float32):
        llm = LLM("tiny-qwen3-next", num_spec=1, draft_dtype=dt)
        assert {p.dtype for p in llm.runner.model.mtp.parameters()} == {torch.float32}


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma4"])
def test_bfloat16_drafter_under_structured_outputs(name):
    """Constrained rows draft under the grammar's masks (the assistant scores its bfloat16 logits
    under them): the output is the target's alone, every constrained output in its language."""
    regex = "[a-z]{4,12}(-[a-z]{4,12}){2}"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=32, structured_outputs=StructuredOutputs(regex=regex)),
              SamplingParams(max_tokens=32, structured_outputs=StructuredOutputs(json=schema,
                                                                                 disable_any_whitespace=True)),
              SamplingParams(max_tokens=16)]
    prompts = PROMPTS[:3]
    want = [o.outputs[0] for o in LLM(name, num_spec=0, **F64).generate(prompts, params)]
    got = [o.outputs[0] for o in LLM(name, num_spec=3, draft_dtype="bfloat16", **F64).generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(regex, got[0].text) and isinstance(json.loads(got[1].text)["n"], int), (got[0].text, got[1].text)
