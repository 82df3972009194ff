"""Structured outputs: a verify step's masks are filled by a worker thread while the verify
forward runs (structured/step_masks.py), and what it fills is what the step would compute
without the overlap; a failure in the worker ends only its request, a failure in the forward
waits for the worker before it surfaces."""

import threading
import time

import pytest

from mtpkit import LLM, SamplingParams, StructuredOutputs
from mtpkit.structured.matcher import RequestGrammar
from mtpkit.structured.step_masks import PendingMasks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
PROMPTS = ["The user is", "def f(x):", "Hello", "Hi"]
PARAMS = [SamplingParams(max_tokens=24, structured_outputs=StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)),
          SamplingParams(max_tokens=24, temperature=1.0, seed=3, structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}")),
          SamplingParams(max_tokens=12, structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe"])),
          SamplingParams(max_tokens=12)]


@pytest.fixture(scope="module")
def llm():
    # float64, eager: drafts or no drafts compute the same logits; the forward is bodies.verify
    llm = LLM("tiny-qwen3-next", num_spec=3, dtype="float64", enforce_eager=True)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def reference(llm):
    """The outputs without speculation's masks in the worker: num_spec 0's tokens, and the same
    LLM's with the fill on the calling thread (overlap off)."""
    base = LLM("tiny-qwen3-next", num_spec=0, dtype="float64", enforce_eager=True)
    tokens = [o.token_ids for o in base.generate(PROMPTS, PARAMS)]
    base.close()
    llm.runner.structured.overlap = False
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == tokens
    finally:
        llm.runner.structured.overlap = True
    return tokens


def test_the_masks_fill_during_the_forward(llm, reference, monkeypatch):
    runner, main = llm.runner, threading.get_ident()
    events, lock = [], threading.Lock()
    in_forward, filling = threading.Event(), threading.Event()

    def log(what, **kw):
        with lock:
            events.append((what, threading.get_ident() == main, kw))

    fill, forward = RequestGrammar.fill_bundle_masks, runner.bodies.verify

    def slow_fill(self, *a):
        filling.set()
        # the first fill waits for the forward to start: without the overlap it never does (2 s)
        log("fill", forward_started=in_forward.wait(2))
        fill(self, *a)

    def watched_forward(*a, **kw):
        in_forward.set()
        log("forward start", fill_started=filling.wait(2))
        out = forward(*a, **kw)
        log("forward end")
        return out

    monkeypatch.setattr(RequestGrammar, "fill_bundle_masks", slow_fill)
    monkeypatch.setattr(runner.bodies, "verify", watched_forward)
    pending_join = PendingMasks.join

    def watched_join(self):
        log("join")
        return pending_join(self)

    monkeypatch.setattr(PendingMasks, "join", watched_join)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference          # the overlap changes no token
    first = next(e for e in events if e[0] == "fill")
    assert not first[1] and first[2]["forward_started"]       # the worker's, while the forward ran
    starts = [e for e in events if e[0] == "forward start"]
    assert starts[0][2]["fill_started"]                        # submitted before the forward
    # every step joins after its forward has returned
    names = [e[0] for e in events if e[0] != "fill"]
    assert names.count("join") >= 2 and all(names[i - 1] == "forward end" for i, n in enumerate(names) if n == "join")
    assert all(e[1] for e in events if e[0] != "fill")         # forward and join on the calling thread
    assert llm.runner.structured.worker_seconds > 0


def test_a_failing_fill_ends_its_request_only(llm, reference, monkeypatch):
    fill, grammar_init, made = RequestGrammar.fill_bundle_masks, RequestGrammar.__init__, []

    def tagged_init(self, *a):
        grammar_init(self, *a)
        made.append(self)               # in the order of the requests: made[1] is the regex's

    def failing_fill(self, *a):
        if self is made[1]:
            raise RuntimeError("planted")
        fill(self, *a)

    monkeypatch.setattr(RequestGrammar, "__init__", tagged_init)
    monkeypatch.setattr(RequestGrammar, "fill_bundle_masks", failing_fill)
    outs = llm.generate(PROMPTS, PARAMS)
    assert outs[1].finish_reason == "error" and "RuntimeError: planted" in outs[1].error
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [t for i, t in enumerate(reference) if i != 1]
    assert all(o.finish_reason != "error" for i, o in enumerate(outs) if i != 1)


def test_a_failing_forward_waits_for_the_worker(llm, reference, monkeypatch):
    runner, fill, done = llm.runner, RequestGrammar.fill_bundle_masks, []

    def slow_fill(self, *a):
        time.sleep(0.05)
        fill(self, *a)
        done.append(time.perf_counter())

    def failing_forward(*a, **kw):
        raise RuntimeError("planted forward")

    monkeypatch.setattr(RequestGrammar, "fill_bundle_masks", slow_fill)
    monkeypatch.setattr(runner.bodies, "verify", failing_forward)
    with pytest.raises(RuntimeError, match="planted forward"):
        llm.generate(PROMPTS, PARAMS)
    raised = time.perf_counter()
    assert done and max(done) < raised       # the worker had finished with the matchers
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
