"""Reliability: an interrupted or abandoned call leaves nothing behind, and a call is refused
whole before anything of it is queued.

- A KeyboardInterrupt (or any exception) inside `generate`, at prefill, at verify or inside a
  graph replay: the call's requests are aborted before control returns (KV blocks and state
  slots back in the pools, nothing waiting or running), the next call's output equals a fresh
  engine's, and requests queued outside the call (`add_request`) still give their tokens.
- A `stream` generator closed or garbage-collected early aborts its requests.
- `LLM.abort(ids)` frees a request's storage at once and finishes it with "abort".
- Every prompt and SamplingParams of a call is validated (seed range included) before any is
  queued.
"""

import gc

import pytest
import torch

import mtpkit.engine.runner as runner_mod
from mtpkit import LLM, InputError, SamplingParams
from mtpkit.engine.request import Status
from mtpkit.engine.scheduler import StepKind

MODEL = "tiny-qwen3-next"
PROMPTS = ["def f():", "import os\n", "class Stack:", "x = [1, 2"]
SP = SamplingParams(max_tokens=24, ignore_eos=True)


def _engine(traced: bool = False, **kw) -> LLM:
    llm = LLM(MODEL, num_spec=2, enforce_eager=not traced, **kw)
    if traced:
        llm.runner.graphs.trace_after = 0   # trace on first use: every verify step replays a trace
    return llm


_REFERENCE: dict = {}


def _reference(traced: bool) -> list[list[int]]:
    """Greedy token ids of PROMPTS on a fresh engine of the same kind."""
    if traced not in _REFERENCE:
        _REFERENCE[traced] = [o.token_ids for o in _engine(traced).generate(PROMPTS, SP)]
    return _REFERENCE[traced]


def _free(llm: LLM) -> tuple[int, int]:
    return llm.kv_pools.num_free, llm.slots.num_free


def _fresh_free(llm: LLM) -> tuple[int, int]:
    """What a fresh engine of this size has free: every block but the null one, every slot group."""
    return llm.kv_pools.capacity, llm.slots.capacity


def _assert_idle(llm: LLM) -> None:
    assert not llm.scheduler.waiting and not llm.scheduler.running, "requests left in the scheduler"
    assert _free(llm) == _fresh_free(llm), "KV blocks or state slots not returned to the pools"


class Fault:
    """Raise KeyboardInterrupt once, on the `at`-th call of the wrapped function (1-based)."""

    def __init__(self, real, at: int = 1, after: bool = False, exc=KeyboardInterrupt):
        self.real, self.at, self.after, self.exc, self.calls, self.fired = real, at, after, exc, 0, False

    def __call__(self, *a, **k):
        self.calls += 1
        fire = self.calls == self.at
        if fire and not self.after:
            self.fired = True
            raise self.exc("injected")
        out = self.real(*a, **k)
        if fire:   # after the real work ran: caches written, results not applied
            self.fired = True
            raise self.exc("injected")
        return out


def _plans(llm: LLM, monkeypatch) -> list:
    """Records the requests of every step from now on."""
    seen = []
    real = llm.runner.execute

    def execute(plan):
        seen.append((plan.kind, [r.req_id for r in plan.reqs]))
        return real(plan)
    monkeypatch.setattr(llm.runner, "execute", execute)
    return seen


def _arm(llm: LLM, where: str, monkeypatch) -> Fault:
    if where == "prefill":           # the sampling of the prompts' first tokens
        f = Fault(runner_mod.rejection_sample, at=1)
        monkeypatch.setattr(runner_mod, "rejection_sample", f)
    elif where == "prefill_after_model":   # the prefill step ran; its results were not applied
        real = llm.runner.execute
        f = Fault(real, at=1, after=True)
        monkeypatch.setattr(llm.runner, "execute", f)
    elif where == "verify":          # the 2nd verify step, after its forward (caches written)
        # (the eager engine calls the verify body itself; a plain greedy step samples nothing on
        # the host: the body's greedy outcome is the step's)
        f = Fault(llm.runner.bodies.verify, at=2, after=True)
        monkeypatch.setattr(llm.runner.bodies, "verify", f)
    elif where == "graph_verify":    # the traced verify graph replayed, then the interrupt
        f = Fault(llm.runner.graphs.verify, at=2, after=True)
        monkeypatch.setattr(llm.runner.graphs, "verify", f)
    elif where == "graph_propose":   # between the verify replay and the proposal replay
        f = Fault(llm.runner.graphs.propose, at=2)
        monkeypatch.setattr(llm.runner.graphs, "propose", f)
    elif where == "graph_trace":     # while torch.jit.trace runs the verify body
        graphs, real_fn = llm.runner.graphs, llm.runner.graphs._verify_fn
        f = Fault(None)

        def verify_fn(context):
            body = real_fn(context)

            def traced_body(*a):
                if torch.jit.is_tracing() and not f.fired:
                    f.fired = True
                    raise KeyboardInterrupt("injected")
                return body(*a)
            return traced_body
        monkeypatch.setattr(graphs, "_verify_fn", verify_fn)
    else:
        raise AssertionError(where)
    return f


WHERE = {"prefill": False, "prefill_after_model": False, "verify": False,
         "graph_trace": True, "graph_verify": True, "graph_propose": True}


@pytest.mark.parametrize("where", sorted(WHERE))
def test_interrupt_in_generate_aborts_the_call(where, monkeypatch):
    traced = WHERE[where]
    llm = _engine(traced)
    assert _free(llm) == _fresh_free(llm)
    fault = _arm(llm, where, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SP)
    assert fault.fired
    _assert_idle(llm)                 # freed before control returned
    monkeypatch.undo()
    plans = _plans(llm, monkeypatch)
    outs = llm.generate(PROMPTS, SP)
    assert [o.token_ids for o in outs] == _reference(traced)
    new_ids = {o.request_id for o in outs}
    assert all(set(ids) <= new_ids for _, ids in plans), "an aborted request ran in a later call"
    _assert_idle(llm)


@pytest.mark.parametrize("where", ["verify", "graph_verify"])
def test_interrupt_leaves_requests_outside_the_call_running(where, monkeypatch):
    """A request queued with add_request shares the interrupted step: it is not aborted, and
    its tokens are still exactly its uninterrupted ones (its caches were written by a step whose
    results were dropped, so it must be recomputed, not continued)."""
    traced = WHERE[where]
    llm = _engine(traced)
    outside = llm.add_request(llm.tokenizer.encode(PROMPTS[0]).ids, SP)
    fault = _arm(llm, where, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1:], SP)
    assert fault.fired
    assert outside.status != Status.FINISHED
    assert list(llm.scheduler.waiting) + llm.scheduler.running == [outside]
    monkeypatch.undo()
    for _ in range(200):
        if outside.status == Status.FINISHED:
            break
        llm.step()
    assert outside.finish_reason == "length"
    assert outside.output_token_ids == _reference(traced)[0]
    _assert_idle(llm)


def test_any_exception_in_generate_aborts_the_call(monkeypatch):
    llm = _engine()
    monkeypatch.setattr(llm.runner.bodies, "verify", Fault(llm.runner.bodies.verify, at=2, exc=RuntimeError))
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, SP)
    _assert_idle(llm)


@pytest.mark.parametrize("how", ["close", "del"])
def test_abandoned_stream_aborts_its_requests(how, monkeypatch):
    llm = _engine()
    g = llm.stream(PROMPTS * 2, SamplingParams(max_tokens=1000, ignore_eos=True))
    next(g)
    assert llm.scheduler.running
    if how == "close":
        g.close()
    else:
        del g
        gc.collect()
    _assert_idle(llm)
    plans = _plans(llm, monkeypatch)
    outs = llm.generate(PROMPTS, SP)
    assert [o.token_ids for o in outs] == _reference(False)
    new_ids = {o.request_id for o in outs}
    assert all(set(ids) <= new_ids for _, ids in plans)
    assert sum(kind == StepKind.VERIFY for kind, _ in plans) <= SP.max_tokens


def test_abort_api():
    llm = _engine(max_num_seqs=2)
    ids = [llm.tokenizer.encode(p).ids for p in PROMPTS]
    reqs = [llm.add_request(p, SP) for p in ids]
    llm.step()
    llm.step()
    running, waiting = reqs[:2], reqs[2:]
    assert all(r.status == Status.RUNNING for r in running) and all(r.status == Status.WAITING for r in waiting)
    assert running[0].block_tables[0].held() and running[0].state_slots
    before = _free(llm)
    n_blocks = len(running[0].block_tables[0].held())
    # one running, one waiting, one unknown id: the unknown one is ignored
    aborted = llm.abort([running[0].req_id, waiting[1].req_id, 10**6])
    assert aborted == sorted([running[0].req_id, waiting[1].req_id])
    for r in (running[0], waiting[1]):
        assert r.status == Status.FINISHED and r.finish_reason == "abort"
        assert r.block_tables == [] and r.state_slots is None
        assert r not in llm.scheduler.running and r not in llm.scheduler.waiting
    assert _free(llm) == ({"full": before[0]["full"] + n_blocks}, before[1] + 1)   # freed at once
    assert llm.abort(running[0].req_id) == []                    # already finished: ignored
    with pytest.raises(InputError, match="request_ids"):
        llm.abort(reqs[1])                                       # a Request, not its id
    for _ in range(300):
        if not llm.scheduler.has_unfinished():
            break
        llm.step()
    ref = _reference(False)
    assert running[1].output_token_ids == ref[1] and waiting[0].output_token_ids == ref[2]
    assert running[0].output_token_ids == ref[0][:len(running[0].output_token_ids)]
    assert waiting[1].output_token_ids == []
    _assert_idle(llm)


def test_abort_from_inside_a_stream_ends_it():
    llm = _engine()
    events = []
    for ev in llm.stream(PROMPTS[:2], SP):
        events.append(ev)
        if ev.index == 0 and not ev.finished:
            llm.abort([ev.output.request_id])
        assert len(events) < 200, "the stream kept waiting for an aborted request"
    finals = {e.index: e.output for e in events if e.finished}
    assert finals[0].finish_reason == "abort" and finals[1].finish_reason == "length"
    assert finals[1].token_ids == _reference(False)[1]
    _assert_idle(llm)


def test_generate_returns_requests_aborted_during_the_call(monkeypatch):
    llm = _engine()
    real = llm.engine.advance   # what a call's stream steps with (engine/loop.py)
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:
            llm.abort([r.req_id for r in llm.scheduler.running[:1]])
        return real()
    monkeypatch.setattr(llm.engine, "advance", step)
    outs = llm.generate(PROMPTS[:2], SP)
    assert [o.finish_reason for o in outs] == ["abort", "length"]
    _assert_idle(llm)


# ---------------------------------------------------------------------------------------------
# a call is validated whole before anything of it is queued
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -1, 2**70])
def test_seed_out_of_range_refuses_the_call_before_queueing(seed, monkeypatch):
    llm = _engine()
    plans = _plans(llm, monkeypatch)
    with pytest.raises(InputError) as ei:
        llm.generate(["def f():", "x"], [SamplingParams(max_tokens=1000),
                                          SamplingParams(temperature=0.7, seed=seed)])
    msg = str(ei.value)
    for w in ("prompt 1", f"seed={seed}", "0..2**64-1"):
        assert w in msg, msg
    assert plans == []
    _assert_idle(llm)
    # the next call runs only its own request
    out = llm.generate(["x"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(ids == [out[0].request_id] for _, ids in plans)


def test_largest_seed_is_accepted():
    llm = _engine()
    sp = SamplingParams(max_tokens=4, temperature=0.7, seed=2**64 - 1, ignore_eos=True)
    a, b = llm.generate(["x"], sp)[0], llm.generate(["x"], sp)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 4


def test_a_bad_second_prompt_queues_nothing(monkeypatch):
    llm = _engine()
    plans = _plans(llm, monkeypatch)
    for bad in (None, 5, {"a": 1}, [1, None]):
        with pytest.raises(InputError):
            llm.generate(["def f():", bad], SP)
        assert plans == []
        _assert_idle(llm)


# ---------------------------------------------------------------------------------------------
# prompt and parameter types
# ---------------------------------------------------------------------------------------------

np = pytest.importorskip("numpy")

from mtpkit import ConfigError  # noqa: E402

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return _engine()


@pytest.fixture(scope="module")
def ids(llm):
    return llm.tokenizer.encode("def f():").ids


@pytest.fixture(scope="module")
def expected(llm, ids):
    return llm.generate([ids], SHORT)[0].token_ids


ID_PROMPTS = {
    "numpy_int64": lambda ids: np.array(ids, dtype=np.int64),
    "numpy_uint16": lambda ids: np.array(ids, dtype=np.uint16),
    "torch_int64": lambda ids: torch.tensor(ids),
    "torch_int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
    "list_of_numpy_ints": lambda ids: [np.int64(t) for t in ids],
    "list_of_torch_scalars": lambda ids: [torch.tensor(t) for t in ids],
    "tuple": lambda ids: tuple(ids),
}


@pytest.mark.parametrize("kind", sorted(ID_PROMPTS))
def test_token_id_prompt_types(kind, llm, ids, expected):
    prompt = ID_PROMPTS[kind](ids)
    assert [o.token_ids for o in llm.generate(prompt, SHORT)] == [expected]          # one prompt
    assert [o.token_ids for o in llm.generate([prompt, ids], SHORT)] == [expected] * 2   # a batch
    _assert_idle(llm)


BAD_PROMPT_TYPES = {
    "none": (None, ["None", "not a prompt", "a str, a list of token ids"]),
    "int": (5, ["5", "not a prompt", "a str, a list of token ids"]),
    "dict": ({"a": 1}, ["dict", "not a prompt", "a str"]),
    "bytes": (b"def", ["bytes", "not a prompt", "a str"]),
    "lone_surrogate": ("def \ud800f():", ["not valid Unicode", "surrogate", "index 4", "errors='replace'"]),
    "array_2d": (np.array([[1, 2], [3, 4]]), ["1-D", "(2, 2)", "list of 1-D arrays"]),
    "float_array": (np.array([1.0, 2.0]), ["integers", "float64", ".astype(int)"]),
    "float_tensor": (torch.tensor([1.0, 2.0]), ["integers", "torch.float32", ".long()"]),
    "none_in_ids": ([1, None, 3], ["None", "outside the vocabulary", "integers, not NoneType"]),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPT_TYPES))
def test_bad_prompt_types(case, llm):
    bad, words = BAD_PROMPT_TYPES[case]
    for prompts in (bad, ["def f():", bad]):
        with pytest.raises(InputError) as ei:
            llm.generate(prompts, SHORT)
        msg = str(ei.value)
        for w in words:
            assert w in msg, (w, msg)
        _assert_idle(llm)
    outs = llm.generate(["def f():", bad], SHORT, errors="return")
    assert outs[1].finish_reason == "error" and words[0] in outs[1].error
    assert outs[0].finish_reason == "length"


BAD_PARAMS = {
    "stop_token_ids_int": (dict(stop_token_ids=5), ["stop_token_ids=5", "list of token ids", "[5]"]),
    "stop_token_ids_bool": (dict(stop_token_ids=[True]), ["stop_token_ids=[True]", "not bools"]),
    "temperature_bool": (dict(temperature=True), ["temperature=True", "a number, not a bool"]),
    "top_p_bool": (dict(top_p=True), ["top_p=True", "not a bool"]),
    "seed_bool": (dict(seed=True, temperature=0.5), ["seed=True", "an int, not a bool"]),
    "ignore_eos_str": (dict(ignore_eos="no"), ["ignore_eos='no'", "True or False"]),
    "ignore_eos_int": (dict(ignore_eos=1), ["ignore_eos=1", "True or False"]),
    "top_k_float_tensor": (dict(top_k=torch.tensor(2.0)), ["top_k=tensor(2.)", "int >= 0"]),
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_bad_sampling_param_types(case, llm):
    kw, words = BAD_PARAMS[case]
    with pytest.raises(InputError) as ei:
        llm.generate(["def f():", "x"], [SHORT, SamplingParams(max_tokens=4, **kw)])
    msg = str(ei.value)
    for w in ["prompt 1", "invalid SamplingParams"] + words:
        assert w in msg, (w, msg)
    _assert_idle(llm)


def test_sampling_params_must_be_sampling_params(llm):
    for sp in ({"max_tokens": 4}, [SHORT, {"max_tokens": 4}]):
        with pytest.raises(InputError) as ei:
            llm.generate(["def f():", "x"], sp)
        msg = str(ei.value)
        for w in ("must be a SamplingParams", "dict", "SamplingParams(**d)"):
            assert w in msg, (w, msg)
        _assert_idle(llm)


def test_numpy_and_torch_scalars_as_sampling_values(llm):
    python = SamplingParams(max_tokens=5, temperature=0.7, top_k=20, top_p=0.9, seed=3,
                            stop_token_ids=[255], ignore_eos=True)
    ref = llm.generate("def f():", python)[0].token_ids
    assert len(ref) == 5
    for sp in (SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.7), top_k=np.int32(20),
                              top_p=np.float64(0.9), seed=np.uint64(3), stop_token_ids=np.array([255]),
                              ignore_eos=np.bool_(True)),
               SamplingParams(max_tokens=torch.tensor(5), temperature=torch.tensor(0.7), top_k=torch.tensor(20),
                              top_p=torch.tensor(0.9), seed=torch.tensor(3), stop_token_ids=[torch.tensor(255)],
                              ignore_eos=torch.tensor(True))):
        out = llm.generate("def f():", sp)[0]
        assert out.token_ids == ref and out.finish_reason == "length"
    r = llm.add_request("x", SamplingParams(max_tokens=np.int64(2), temperature=np.float32(0.5)))
    assert type(r.params.max_tokens) is int and type(r.params.temperature) is float
    llm.abort(r.req_id)
    _assert_idle(llm)


BAD_CONFIGS = {
    "num_state_slots_0": (dict(num_state_slots=0),
                          ["num_state_slots=0", "holds no request", "num_spec + 1 = 3", "num_state_slots >= 4",
                           "25 for max_num_seqs=8", "leave it unset"]),
    "num_state_slots_1": (dict(num_state_slots=1), ["num_state_slots=1", "holds no request", ">= 4"]),
    "num_state_slots_3": (dict(num_state_slots=3), ["num_state_slots=3", "holds no request", ">= 4"]),
    "state_cache_memory_tiny": (dict(state_cache_memory=10), ["state_cache_memory=10", "0 state slots",
                                                              "holds no request", "state_cache_memory >= "]),
    "max_num_seqs_0": (dict(max_num_seqs=0), ["max_num_seqs=0", ">= 1"]),
    "max_num_batched_tokens_0": (dict(max_num_batched_tokens=-3), ["max_num_batched_tokens=-3", ">= 1"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_pool_configs(case):
    kw, words = BAD_CONFIGS[case]
    with pytest.raises(ConfigError) as ei:
        LLM(MODEL, num_spec=2, **kw)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)
    assert "max_state_reqs" not in msg


def test_interrupt_while_queueing_a_call_queues_nothing(monkeypatch):
    """Queueing is all or nothing: an interrupt between two requests of a call unqueues the first."""
    llm = _engine()
    fault = Fault(llm._enqueue, at=2)
    monkeypatch.setattr(llm, "_enqueue", fault)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SP)
    assert fault.fired
    _assert_idle(llm)


def test_requests_compare_by_identity():
    """A Request is mutable engine state: the scheduler's and stream's membership tests compare
    identities (a field-by-field __eq__ made them quadratic in a call's requests), and two
    requests with the same fields are still two requests."""
    from mtpkit.engine.request import Request

    a, b = (Request(7, [1, 2, 3], SP, (0,), None) for _ in range(2))
    assert a == a and a != b and len({a, b}) == 2 and [a].count(b) == 0
