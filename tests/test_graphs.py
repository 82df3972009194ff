"""The graph path (static buffers keyed by num_reqs_padded; CPU replay) and the regression
cases other engines hit (docs/design.md, "Regression cases", items 1-8).

On CPU a replay is a TorchScript trace of the captured bodies once a shape has been called
`trace_after` times; these tests trace from the first replay (trace_after=0) unless they say
otherwise, so the traced path is what they check."""

import functools

import pytest
import torch

import oracle
import spec_models
from mtpkit import LLM, ConfigError, SamplingParams
from mtpkit.shapes import is_debug
from mtpkit.graphs import build_capture_plan

F64 = dict(dtype="float64", device="cpu")


@pytest.fixture(scope="module")
def ckdir(tmp_path_factory):
    return tmp_path_factory.mktemp("graphs")


@functools.lru_cache(maxsize=None)
def _ck(root, mode="bigram", eps=0.1, cfg="base", seed=0):
    return spec_models.build_spec_checkpoint(f"{root}/{cfg}_{mode}_{eps}_{seed}", cfg, seed, mode, eps)


def _traced_from_start(llm: LLM, trace_after: int = 0) -> LLM:
    if llm.runner.graphs is not None:
        llm.runner.graphs.trace_after = trace_after
    return llm


def _run(path, prompts, max_tokens=14, trace_after=0, **kw):
    llm = _traced_from_start(LLM(path, max_model_len=128, **F64, **kw), trace_after)
    steps = []
    orig = llm.runner.execute
    llm.runner.execute = lambda plan: (steps.append((plan.kind.value, plan.num_reqs, plan.num_reqs_padded)),
                                       orig(plan))[1]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], llm, steps


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("n,padded", [(3, 4), (5, 8)])
@pytest.mark.parametrize("trace_after", [0, 3, None])
def test_graph_path_equals_eager(ckdir, k, n, padded, trace_after):
    """Traced from the first replay (0), after three direct calls of each shape (3: traces
    made mid-generation, over buffers that held real rows), or never (None: direct calls)."""
    path = _ck(str(ckdir))
    prompts = oracle.random_prompts(n, 256, seed=n, lengths=[1, 9, 17, 30, 44][:n])
    eager, _, _ = _run(path, prompts, num_spec=k, enforce_eager=True, max_num_seqs=8)
    graph, llm, steps = _run(path, prompts, num_spec=k, max_num_seqs=8,
                             trace_after=10**9 if trace_after is None else trace_after)
    assert graph == eager
    assert llm.runner.graphs is not None and llm.engine.capture_plan.sizes == (1, 2, 4, 8)
    traced = [key for key in llm.runner.graphs.verify_graphs]
    # debug mode calls the bodies on every step (each step's shapes checked): nothing traced
    assert bool(traced) == (trace_after is not None and not is_debug()), traced
    assert all(isinstance(key, tuple) and key[1] >= 64 for key in traced)
    # The MTP proposal after a prefill runs traced too: tokens padded to a power of two (>= 16),
    # rows padded like a decode step.
    proposals = list(llm.runner.graphs.prefill_proposal_graphs)
    assert bool(proposals) == (trace_after == 0 and k >= 1 and not is_debug()), proposals
    assert all(t >= 16 and t & (t - 1) == 0 and n in llm.engine.capture_plan.sizes for t, n, _ in proposals)
    verify = [s for s in steps if s[0] == "verify"]
    assert (n, padded) in [(r, p) for _, r, p in verify], "the step count needing padding must occur"
    assert all(p == llm.engine.capture_plan.dispatch(r) for _, r, p in verify)


def test_failed_trace_falls_back_to_direct_calls(ckdir, monkeypatch):
    """A CPU graph that cannot be traced warns and the engine goes on calling the bodies."""
    path = _ck(str(ckdir))
    prompts = oracle.random_prompts(3, 256, seed=3, lengths=[1, 9, 17])
    eager, _, _ = _run(path, prompts, num_spec=2, enforce_eager=True, max_num_seqs=8)

    def broken(*a, **k):
        raise RuntimeError("no tracer here")

    monkeypatch.setattr(torch.jit, "trace", broken)
    with pytest.warns(RuntimeWarning, match="tracing a CPU decode graph failed.*no tracer here"):
        graph, llm, _ = _run(path, prompts, num_spec=2, max_num_seqs=8)
    g = llm.runner.graphs
    assert graph == eager and not g.trace and not g.verify_graphs and not g.prefill_proposal_graphs


def test_large_steps_keep_a_fixed_shape_moe_path(ckdir, monkeypatch):
    """Above dense_limit token-expert pairs the MoE loops over the experts it routed to, a
    path whose shapes follow the routing: a graph must not take it (a trace would replay the
    routing it was traced with). Lowering the limit makes every verify step that large."""
    from mtpkit.layers.moe import SparseMoE

    path = _ck(str(ckdir))
    prompts = oracle.random_prompts(5, 256, seed=5, lengths=[1, 9, 17, 30, 44])
    monkeypatch.setattr(SparseMoE, "dense_limit", 4)
    eager, _, _ = _run(path, prompts, num_spec=2, enforce_eager=True, max_num_seqs=8)
    graph, llm, _ = _run(path, prompts, num_spec=2, max_num_seqs=8)
    g = llm.runner.graphs
    assert graph == eager
    assert g.trace and g.verify_graphs and g.propose_graphs  # traced, not fallen back


def _fill_null(llm, value):
    for t in llm.cache.tensors():
        t[0].fill_(value)


def _padded_run(path, k, prompts, null_value, **kw):
    llm = _traced_from_start(LLM(path, num_spec=k, max_model_len=64, **F64, **kw))
    _fill_null(llm, null_value)
    reqs = [llm.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    llm.step()  # prefill all three
    for _ in range(3):  # verify steps with 3 real rows (padded to 4 unless eager)
        llm.step()
    assert all(r.status.value == "running" for r in reqs)
    return llm, reqs


def _real_storage(llm):
    """Every KV block and state slot except the null ones."""
    return [t[1:] for t in llm.cache.tensors()]


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("sentinel", [1e4, float("nan")])
def test_padded_rows_are_inert(ckdir, k, sentinel):
    """Null block and null slot filled with sentinels: 3 requests padded to 4 leave every real
    request's KV and GDN state equal (to 1e-12, the rounding of two separately loaded engines)
    to the same padded run over zeroed null storage (nothing read from null storage reaches a
    real row), and equal to an unpadded run up to
    rounding (CPU GEMMs round differently for 9 and 12 rows, so bitwise equality across
    different batch shapes is not a property of the hardware), with identical tokens."""
    path = _ck(str(ckdir))
    prompts = oracle.random_prompts(3, 256, seed=7, lengths=[5, 12, 20])
    pad = dict(graph_sizes=[4], max_num_seqs=4)
    a, ra = _padded_run(path, k, prompts, sentinel, **pad)
    z, rz = _padded_run(path, k, prompts, 0.0, **pad)
    b, rb = _padded_run(path, k, prompts, sentinel, enforce_eager=True, max_num_seqs=4)
    assert [r.output_token_ids for r in ra] == [r.output_token_ids for r in rz] == \
        [r.output_token_ids for r in rb]
    for x, y, u in zip(_real_storage(a), _real_storage(z), _real_storage(b)):
        # a and z are separately loaded engines: MKL may round their GEMMs differently in the
        # last ulp (alignment, CPU), so not bitwise; a sentinel leaking into a real row would
        # show as NaN or as an error of order 1e4, far beyond 1e-12.
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        torch.testing.assert_close(x, u, rtol=0, atol=1e-12)
    # the padded rows did run: in the zero-filled run they wrote into the null block and slot
    assert z.cache.kv["attention"][0][0][0].abs().sum() > 0 and z.cache.state["gdn"][0]["ssm"][0].abs().sum() > 0
    # the unpadded run has no padded rows: its null block still holds the sentinel
    null = b.cache.kv["attention"][0][0][0]
    torch.testing.assert_close(null, torch.full_like(null, sentinel), rtol=0, atol=0, equal_nan=True)


# ---- regression cases (docs/design.md) ------------------------------------------------------

def test_regression_1_ragged_capture_sizes_fail_fast_with_corrected_list(ckdir, monkeypatch):
    """The seed failure: num_spec=2 (bundle 3) with capture sizes [1, 2, 4, 8, 16, 32] in
    tokens. It must be a ConfigError at construction, naming the sizes and the fix, before
    any weight is read; the same numbers as request counts run."""
    import mtpkit.checkpoint.loader as loader
    path = _ck(str(ckdir))
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ConfigError) as e:
        LLM(path, num_spec=2, max_num_seqs=32, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32], **F64)
    msg = str(e.value)
    assert "[1, 2, 4, 8, 16, 32]" in msg and "bundle 3" in msg and "graph_sizes=" in msg
    monkeypatch.undo()
    llm = LLM(path, num_spec=2, max_num_seqs=32, graph_sizes=[1, 2, 4, 8, 16, 32], **F64)
    assert llm.engine.capture_plan.token_sizes == (3, 6, 12, 24, 48, 96)
    out = llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=5, ignore_eos=True))
    assert all(len(o.token_ids) == 5 for o in out)


def test_regression_2_three_requests_padded_to_four(ckdir):
    """A padded row counted as a prefill gave NaN logits and prev_num_emitted = -1: here padded
    rows are inert verify rows; real rows stay finite and accept >= 1."""
    path = _ck(str(ckdir), eps=0.0)
    llm = LLM(path, num_spec=2, max_num_seqs=4, graph_sizes=[4], max_model_len=64, **F64)
    reqs = [llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
            for p in ([1, 2], [3, 4, 5], [6])]
    llm.step()
    while llm.scheduler.has_unfinished():
        llm.step()
        assert all(1 <= r.prev_num_emitted <= 3 for r in reqs)
    logits = llm.runner.graphs.outputs[4]["logits"]
    assert torch.isfinite(logits[:3 * 3]).all()
    assert llm.stats.num_accepted > 0


def test_regression_3_padded_conv_batch(ckdir):
    """Padding changed the batch the conv kernel saw and tripped a shape assert: the conv
    runs over num_reqs_padded rows whatever the real count, with shapes checked in debug."""
    import mtpkit
    path = _ck(str(ckdir), cfg="five_layer")
    llm = LLM(path, num_spec=1, max_num_seqs=8, max_model_len=64, **F64)
    with mtpkit.debug() as trace:
        llm.generate(oracle.random_prompts(5, 256, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))
    conv = [e for e in trace if e.function.endswith("causal_conv1d_verify")]
    assert conv and all(e.dims["num_reqs_padded"] in (1, 2, 4, 8) for e in conv)
    assert {e.dims["num_reqs_padded"] for e in conv} >= {8}


def test_regression_4_state_pool_too_small(ckdir, monkeypatch):
    import mtpkit.checkpoint.loader as loader
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ConfigError, match="state-slot pool holds 3 requests"):
        LLM(_ck(str(ckdir)), num_spec=2, max_num_seqs=8, num_state_slots=10, **F64)


def test_regression_5_all_drafts_rejected_keeps_state_in_range(ckdir):
    """num_accepted == 0 read slot -1: here a >= 1 always, and all-reject decoding equals
    non-speculative decoding (state correct after every rollback)."""
    path = _ck(str(ckdir), mode="all_reject")
    prompts = oracle.random_prompts(3, 256, seed=9, lengths=[4, 20, 33])
    ref, _, _ = _run(path, prompts, max_tokens=16)
    out, llm, _ = _run(path, prompts, max_tokens=16, num_spec=3)
    assert out == ref and llm.stats.num_accepted == 0


def test_regression_6_no_offset_zero_step_after_spec(ckdir):
    """A non-spec step after a spec step read the conv state at offset 0. Here the verify path
    is the only decode path: a request near its end (0 drafts allowed) still reads offset a-1,
    and its tokens equal non-speculative decoding."""
    path = _ck(str(ckdir), eps=0.0)
    prompts = oracle.random_prompts(4, 256, seed=2, lengths=[3, 8, 13, 21])
    for mt in (2, 5, 9):  # ends where only 0 or 1 drafts fit
        ref, _, _ = _run(path, prompts, max_tokens=mt)
        out, _, _ = _run(path, prompts, max_tokens=mt, num_spec=4)
        assert out == ref


def test_regression_7_max_capture_size_not_truncated(ckdir):
    path = _ck(str(ckdir))
    llm = LLM(path, num_spec=1, max_num_seqs=13, graph_sizes=[1, 4], **F64)
    assert llm.engine.capture_plan.sizes[-1] == 13
    with pytest.raises(ConfigError, match="above max_num_seqs"):
        LLM(path, num_spec=1, max_num_seqs=8, graph_sizes=[1, 16], **F64)


def test_regression_8_token_sizes_rounded_to_bundle(ckdir):
    plan = build_capture_plan(num_spec=3, max_num_seqs=8, cudagraph_capture_sizes=[4, 8, 16])
    assert all(t % 4 == 0 for t in plan.token_sizes) and plan.sizes == (1, 2, 4, 8)
    with pytest.raises(ConfigError, match="not multiples of 4"):
        build_capture_plan(num_spec=3, max_num_seqs=8, cudagraph_capture_sizes=[4, 6])


def test_debug_trace_shows_step_shapes(ckdir):
    import mtpkit
    llm = LLM(_ck(str(ckdir)), num_spec=2, max_num_seqs=4, **F64)
    with mtpkit.debug() as trace:
        llm.generate(oracle.random_prompts(3, 256, seed=4), SamplingParams(max_tokens=4, ignore_eos=True))
    steps = [e for e in trace if e.function == "step.metadata.UniformMetadata" and e.dims.get("q_len") == 3]
    assert steps and all({"num_reqs_padded", "q_len"} <= set(e.dims) for e in steps)
    assert any(e.dims.get("num_reqs") == 3 and e.dims["num_reqs_padded"] == 4 for e in steps)
    # One meaning per name: a step padded to 4 rows has the 3 requests (fewer run 1 or 2 rows,
    # unpadded). "num_reqs" is the real count wherever it is shown (the step built on the
    # host); metadata that knows only the padded rows (a step body's, which a graph replays for
    # any real count) does not show it, and never calls the padded count num_reqs.
    assert {e.dims["num_reqs"] for e in steps if "num_reqs" in e.dims and e.dims["num_reqs_padded"] == 4} == {3}
    assert any("num_reqs" not in e.dims for e in steps)
    assert "num_reqs_padded=4" in trace.table()
    assert any(e.dims.get("bundle") == 3 for e in trace)
    # A drafter's one-token passes have their own dimension (q_len 1): "bundle" means
    # num_spec + 1 in every row of the trace, never the query tokens of a draft pass.
    passes = [e for e in trace if e.dims.get("q_len") == 1]
    assert passes and all("bundle" not in e.dims for e in passes)


def test_graph_path_proposes_the_drafts_of_eager():
    """Drafts never change the output (a wrong proposal only lowers acceptance), so the token
    tests above cannot see a broken proposal graph. With the embedded model, whose drafts are
    mostly accepted, every step's drafts through the traced graphs (3 requests padded to 4,
    the proposal after prefill traced too) equal the eager engine's."""
    prompts = ["def fibonacci(n):", "import os\n\nclass Walker:\n    def __init__(self, root):",
               "for i in range(10):\n    print("]

    def run(**kw):
        llm = LLM("tiny-qwen3-next", num_spec=3, max_num_seqs=4, **kw)
        if llm.runner.graphs is not None:
            llm.runner.graphs.trace_after = 0
        drafts, orig = [], llm.runner.execute
        llm.runner.execute = lambda plan: (lambda res: (drafts.append([r.drafts for r in res]), res)[1])(orig(plan))
        out = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))]
        return out, drafts, llm

    eager_out, eager_drafts, _ = run(enforce_eager=True)
    graph_out, graph_drafts, llm = run()
    g = llm.runner.graphs
    assert g.trace and g.propose_graphs and g.prefill_proposal_graphs or is_debug()
    assert graph_out == eager_out
    assert graph_drafts == eager_drafts
    assert llm.stats.mean_acceptance_length > 2.5  # drafts worth comparing


def test_a_dropped_engine_frees_its_traced_graphs_and_weights():
    """torch.jit.trace keeps every traced function, with its constants (the weights), in its
    process-wide compilation unit unless told otherwise: an engine built and dropped (a notebook
    rebuilding its LLM, a test suite) must leave nothing behind."""
    import gc
    import weakref
    before = len(torch.jit._state._python_cu.get_functions())
    llm = LLM("tiny-qwen3-next", num_spec=3)
    llm.runner.graphs.trace_after = 0
    llm.generate(["def f(x):"] * 2, SamplingParams(max_tokens=24))
    assert llm.runner.graphs.verify_graphs, "nothing was traced"
    weights = [weakref.ref(p) for p in llm.model.parameters()]
    del llm
    gc.collect()
    assert len(torch.jit._state._python_cu.get_functions()) == before
    assert not [w for w in weights if w() is not None], "weights kept alive after the engine was dropped"


@pytest.mark.parametrize("k", [0, 2])
def test_captured_prefill_equals_eager(ckdir, k):
    """One prompt per call, so every prefill step holds one chunk and replays the traced prefill
    (CapturedSteps.prefill: the chunk padded at its end to a power of two >= 16, keyed by tokens
    and context bucket). 16-token chunks: a 44-token prompt prefills as 16 + 16 + 12 (later chunks
    read the KV and recurrent state the earlier left), a 1-token prompt pads 15 tokens. Prefix
    cache off: a step that writes state snapshots runs eager (below). The layers at full scale
    (eps 1): the output depends on the state and KV the earlier chunks left."""
    path = _ck(str(ckdir), eps=1.0)
    prompts = oracle.random_prompts(4, 256, seed=11, lengths=[1, 9, 30, 44])

    def run(**kw):
        llm = _traced_from_start(LLM(path, max_model_len=128, num_spec=k, max_num_batched_tokens=16,
                                     enable_prefix_caching=False, **F64, **kw))
        sp = SamplingParams(max_tokens=10, ignore_eos=True)
        return [llm.generate([p], sp)[0].token_ids for p in prompts], llm
    eager, _ = run(enforce_eager=True)
    graph, llm = run()
    assert graph == eager
    assert sorted(llm.runner.graphs.prefill_graphs) == ([] if is_debug() else [(16, 64, 0)])


def test_captured_prefill_writes_the_state_snapshots(ckdir):
    """With the prefix cache on (snapshots every 16 tokens), a prefill writes state snapshots
    inside its chunk: the captured prefill writes them too (a graph per snapshot count). A second
    prompt sharing the first's 48-token prefix resumes from one of them: tokens equal eager's
    without the cache, and it hits as much of the cache as an eager engine's with it."""
    path = _ck(str(ckdir), eps=1.0)
    first = oracle.random_prompts(1, 256, seed=12, lengths=[52])[0]
    second = first[:48] + oracle.random_prompts(1, 256, seed=13, lengths=[9])[0]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(**kw):
        llm = _traced_from_start(LLM(path, max_model_len=128, num_spec=2, prefix_snapshot_interval=16, **F64, **kw))
        snapshots = []
        orig = llm.runner.execute
        llm.runner.execute = lambda plan: (snapshots.append(len(plan.snapshots)), orig(plan))[1]
        return [llm.generate([p], sp)[0] for p in (first, second)], llm, snapshots
    uncached, _, _ = run(enforce_eager=True, enable_prefix_caching=False)
    eager, _, _ = run(enforce_eager=True)
    outs, llm, snapshots = run()
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager] == [o.token_ids for o in uncached]
    assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in eager] and outs[1].num_cached_tokens
    assert snapshots[0] == 3
    assert is_debug() or (64, 64, 3) in llm.runner.graphs.prefill_graphs
