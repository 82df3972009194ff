"""Compiled CPU decode graphs (LLM(compile=...), mtpkit/graphs/compiled.py): greedy tokens
compiled == traced == eager, float64 random models.

Inductor's C++ compilation costs about 2 CPU minutes per model here with empty caches (measured:
131 s CPU for the three graphs of the Qwen3-Next below), more than the suite's budget for this
file, so the default run compiles with dynamo's capture and the "aot_eager" backend
(graphs.compiled.BACKEND): the same fullgraph capture, guards, per-graph code objects, lazy
swap and MoE capture path, without inductor's code generation. The tests that run inductor and
AOTInductor for real run with MTPKIT_TEST_COMPILE=1 (and are skipped, saying so, without it);
benchmarks/compile_modes.py checks every mode's tokens on both embedded models, num_spec 0 and 3."""

import os
import sys
from pathlib import Path

import pytest
import torch

from mtpkit.graphs import compiled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_oracle as G  # noqa: E402
import oracle  # noqa: E402
import spec_models  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.errors import ConfigError  # noqa: E402
from mtpkit.graphs.compiled import LazyCompiled, body_modules, model_identity  # noqa: E402
from mtpkit.layers.moe import SparseMoE  # noqa: E402

F64 = dict(dtype="float64", device="cpu", max_model_len=64, max_num_seqs=1)
PROMPT = [3, 17, 5, 9, 30, 2, 11, 8]
SP = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    cfg = dict(oracle.TINY_CONFIGS["gqa4_hd32_top3"])
    return spec_models.build_spec_checkpoint(tmp_path_factory.mktemp("compiled") / "qwen", cfg, seed=3,
                                             mode="bigram", eps=0.3)


@pytest.fixture(scope="module")
def reference(qwen):
    """(eager tokens, traced tokens) at num_spec 3."""
    eager = LLM(qwen, num_spec=3, enforce_eager=True, **F64).generate([PROMPT], SP)[0].token_ids
    llm = LLM(qwen, num_spec=3, **F64)
    llm.runner.graphs.trace_after = 0
    before = model_identity(body_modules(llm.model, llm.drafter))
    traced = llm.generate([PROMPT], SP)[0].token_ids
    # "freeze" and "aot" bake the weights in: nothing may write them after load.
    assert model_identity(body_modules(llm.model, llm.drafter)) == before
    return eager, traced


REAL = pytest.mark.skipif(not os.environ.get("MTPKIT_TEST_COMPILE"),
                          reason="inductor / AOTInductor compile for minutes cold: set MTPKIT_TEST_COMPILE=1")


@pytest.fixture
def dynamo_only(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


def _compiled(path, mode, **kw):
    llm = LLM(path, compile=mode, compile_after=0, **F64, **kw)
    llm.runner.graphs.trace_after = 0
    return llm.generate([PROMPT], SP)[0].token_ids, llm


def _compiled_names(llm) -> set[str]:
    g = llm.runner.graphs
    graphs = (list(g.verify_graphs.values()) + list(g.propose_graphs.values()) + list(g.prefill_proposal_graphs.values())
              + list(g.prefill_graphs.values()) + list(g.decode_graphs.values()))
    assert all(isinstance(x, LazyCompiled) for x in graphs if x is not None)
    assert not [r for r in g.compiler.records if r.error], g.compiler.records
    return {r.name for r in g.compiler.records}


def test_dynamo_capture_equals_trace_and_eager(qwen, reference, dynamo_only, monkeypatch):
    """Lazily (compile_after=2): a graph's trace serves its first two replays, then the compiled
    graph replays; tokens equal the trace's and eager's throughout. With the MoE's dense_limit at
    0 a step not seen as captured would take the grouped path (shapes follow the routing), which
    fullgraph capture refuses: the compiled graphs must see themselves as captured."""
    eager, traced = reference
    assert traced == eager
    monkeypatch.setattr(SparseMoE, "dense_limit", 0)
    llm = LLM(qwen, num_spec=3, compile="inductor", compile_after=2, **F64)
    g = llm.runner.graphs
    g.trace_after = 0
    # the prefill's token, then at most 2 verify steps: each graph's trace serves them
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids == eager[:3]
    assert g.verify_graphs[1, 64].compiled is None and not g.compiler.records
    assert llm.generate([PROMPT], SP)[0].token_ids == eager
    assert _compiled_names(llm) == {"verify_1_64", "propose_1_64"}   # the prefill proposal ran twice: traced
    assert "compiled by inductor" in g.describe()


def test_dynamo_capture_of_the_prefill_at_once(qwen, reference, dynamo_only, monkeypatch):
    """compile_after=0: every graph compiled at its first replay, the target's prefill too (its
    16-token step must take the MoE's fixed-shape path under capture: dense_limit 0 would send an
    eager step of that size to the grouped one); tokens equal eager's (num_spec 0: the same greedy
    tokens, two graphs to compile instead of four)."""
    eager, _ = reference
    monkeypatch.setattr(SparseMoE, "dense_limit", 0)
    out, llm = _compiled(qwen, "inductor", num_spec=0)
    assert _compiled_names(llm) == {"verify_1_64", "prefill_16_64"}
    assert out == eager


@REAL
def test_inductor_equals_trace_and_eager(qwen, reference):
    eager, traced = reference
    assert traced == eager
    out, llm = _compiled(qwen, "inductor", num_spec=3)
    assert _compiled_names(llm) == {"verify_1_64", "propose_1_64", "prefill_proposal_16_1_64", "prefill_16_64"}
    assert out == eager
    assert "compiled by inductor" in llm.runner.graphs.describe()


@REAL
@pytest.mark.parametrize("mode", ["aot", "aot-tuned"])
def test_aot_packages_equal_eager_and_load_from_the_cache(qwen, reference, tmp_path_factory, mode):
    eager, _ = reference
    cache = tmp_path_factory.mktemp("aot")
    out, llm = _compiled(qwen, mode, num_spec=3, compile_cache_dir=cache)
    assert _compiled_names(llm) == {"verify_1_64", "propose_1_64", "prefill_proposal_16_1_64", "prefill_16_64"}
    assert out == eager
    assert len(list(cache.glob("*.pt2"))) == 4
    warm, llm = _compiled(qwen, mode, num_spec=3, compile_cache_dir=cache)
    assert warm == eager
    assert all(r.cached for r in llm.runner.graphs.compiler.records)


def test_aot_modes_name_different_packages(tmp_path):
    """"aot" and "aot-tuned" compile the same graph differently: one must never load the other's."""
    from mtpkit.graphs.compiled import Compiler
    mods, args = [torch.nn.Linear(4, 4)], (torch.zeros(1, 4),)
    paths = {Compiler(m, mods, cache_dir=tmp_path).package_path(args, "verify_1_64") for m in ("aot", "aot-tuned")}
    assert len(paths) == 2


def test_packages_of_different_num_spec_have_different_names(tmp_path):
    """The Gemma 4 assistant keeps no cache of its own, so its prefill proposal's arguments have
    the same shapes at any num_spec, and the weights are the same: the drafter's settings must
    name the package too (a num_spec=2 engine once loaded num_spec=3's and drafted 3 tokens)."""
    paths = set()
    for k in (2, 3):
        llm = LLM("tiny-gemma4", num_spec=k, compile="aot", compile_after=10 ** 9, compile_cache_dir=tmp_path)
        paths.add(llm.runner.graphs.compiler.package_path((torch.zeros(16, 4),), "prefill_proposal_16_1_64"))
    assert len(paths) == 2
    assert not list(tmp_path.iterdir())   # nothing compiled

def test_gemma4_without_drafts(tmp_path_factory, dynamo_only):
    path = tmp_path_factory.mktemp("compiled") / "gemma4"
    G.save(G.build_hf("dense"), path)
    prompt = oracle.random_prompt(9, 128, seed=49)
    eager = LLM(path, enforce_eager=True, **F64).generate([prompt], SP)[0].token_ids
    llm = LLM(path, compile="inductor", compile_after=0, **F64)
    llm.runner.graphs.trace_after = 0
    assert llm.generate([prompt], SP)[0].token_ids == eager
    assert _compiled_names(llm) == {"verify_1_64", "prefill_16_64"}   # its prefill too (gemma4: a uniform row)


@pytest.mark.parametrize("kw", [dict(compile="jit"), dict(compile="inductor", compile_after=-1)])
def test_bad_compile_arguments(qwen, kw):
    with pytest.raises(ConfigError, match="compile"):
        LLM(qwen, **kw, **F64)


def test_default_is_the_trace(qwen):
    llm = LLM(qwen, **F64)
    assert llm.runner.graphs.compiler is None
    assert "compiled" not in llm.runner.graphs.describe()
    assert torch.jit.is_tracing() is False


def test_package_names_hash_the_code_graphs_run():
    """A package's name hashes every source file a step body can run (models, layers, kernels,
    the drafters, step data, sampling, the captured bodies) and leaves out host-only files, so
    that editing the engine loop or the front ends keeps the cache warm."""
    from mtpkit.graphs.compiled import identity_sources
    src = Path(compiled.__file__).resolve().parents[1]
    names = {f.relative_to(src).as_posix() for f in identity_sources()}
    for graph_code in ("models/qwen3_next/model.py", "models/gemma4/model.py", "layers/moe.py", "kernels/gdn.py",
                       "speculative/mtp.py", "speculative/gemma4_assistant.py", "step/metadata.py",
                       "sampling/rejection.py", "sampling/controls.py", "graphs/captured.py",
                       "graphs/specialize.py", "engine/step_bodies.py", "shapes.py"):
        assert graph_code in names, graph_code
    for host in ("engine/runner.py", "engine/scheduler.py", "llm.py", "text/detokenize.py", "graphs/compiled.py",
                 "serve/app.py", "notebook/view.py"):
        assert host not in names, host


# ---- every num_spec and batch size, both families ------------------------------------------
# (num_spec, batch): compiled tokens == eager tokens. CI runs a subset under dynamo's capture
# ("aot_eager"; 10-30 s a case here, so three: both batch sizes and both families, num_spec 0, 2
# and 4, with num_spec 3 above); the whole cross, 0..4 x {1, 8} x both families, runs under
# inductor for real with MTPKIT_TEST_COMPILE=1.
MATRIX = [(k, b) for k in range(5) for b in (1, 8)]
CI_MATRIX = {"qwen": [(0, 8), (4, 1)], "gemma4": [(2, 8)]}
MATRIX_SP = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma4_pair(tmp_path_factory):
    import gemma4_assistant_oracle as A
    d = tmp_path_factory.mktemp("compiled") / "gemma4_pair"
    A.save(A.build_target("dense", 5), d / "target")
    A.save(A.build_assistant("dense", 5), d / "assistant")
    return d / "target", d / "assistant"


def _matrix_case(family, k, batch, qwen, gemma4_pair, mode, steps=1, sp=MATRIX_SP):
    """`steps`: num_scheduler_steps (num_spec 0): the decode runs' graph is compiled too. `sp`:
    the params (a list: per prompt)."""
    if family == "qwen":
        path, kw = qwen, {}
    else:
        path, kw = gemma4_pair[0], ({"draft_model": gemma4_pair[1]} if k else {})
    prompts = [oracle.random_prompt(5 + 3 * i, 128, seed=70 + i) for i in range(batch)]   # both vocabularies >= 128
    base = dict(F64, max_num_seqs=batch, num_spec=k, **kw)
    eager = LLM(path, enforce_eager=True, **base).generate(prompts, sp)
    llm = LLM(path, compile=mode, compile_after=0, num_scheduler_steps=steps, **base)
    llm.runner.graphs.trace_after = 0
    out = llm.generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in eager], \
        f"{family} num_spec={k} batch={batch} compiled ({mode}) != eager"
    # the drafts too (a wrong drafter changes only what is accepted): float64, the same argmax
    assert [o.outputs[0].spec_stats.accepted_per_position for o in out] == \
        [o.outputs[0].spec_stats.accepted_per_position for o in eager], "compiled drafts != eager drafts"
    names = _compiled_names(llm)
    assert any(n.startswith("verify_") for n in names), names
    assert k == 0 or any(n.startswith("propose_") for n in names), names
    assert (steps > 1) == any(n.startswith("decode_") for n in names), names
    return names


@pytest.mark.parametrize("family,k,batch", [(f, k, b) for f, cases in CI_MATRIX.items() for k, b in cases])
def test_compiled_equals_eager_across_num_spec_and_batch(family, k, batch, qwen, gemma4_pair, dynamo_only):
    names = _matrix_case(family, k, batch, qwen, gemma4_pair, "inductor")
    if batch == 8:   # the 8 prompts run as one batch: graph size 8
        assert any(n.startswith("verify_8_") for n in names), names


def _seeded(batch: int) -> list[SamplingParams]:
    """Seeded random rows (top-k, top-p, min-p) and a greedy one: what a decode run samples in its graph."""
    return [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.7, seed=40 + i, top_k=[0, 12][i % 2],
                           top_p=[1.0, 0.9][i // 2 % 2], min_p=0.02 * (i % 3 == 2)) if i % 4 != 3
            else MATRIX_SP for i in range(batch)]


@pytest.mark.parametrize("family,batch,steps,sampled", [("qwen", 8, 3, False), ("gemma4", 1, 4, False),
                                                        ("qwen", 8, 3, True), ("gemma4", 1, 4, True)])
def test_compiled_decode_runs_equal_eager(family, batch, steps, sampled, qwen, gemma4_pair, dynamo_only):
    names = _matrix_case(family, 0, batch, qwen, gemma4_pair, "inductor", steps,
                         _seeded(batch) if sampled else MATRIX_SP)
    assert any(n.startswith(f"decode_{batch}_64") and (len(n.split("_")) > 3) == sampled for n in names), names


@REAL
@pytest.mark.parametrize("family", ["qwen", "gemma4"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("sampled", [False, True])
def test_compiled_decode_runs_for_real(family, batch, sampled, qwen, gemma4_pair):
    _matrix_case(family, 0, batch, qwen, gemma4_pair, "aot", 4, _seeded(batch) if sampled else MATRIX_SP)


@REAL
@pytest.mark.parametrize("family", ["qwen", "gemma4"])
@pytest.mark.parametrize("k,batch", MATRIX)
def test_compiled_matrix_for_real(family, k, batch, qwen, gemma4_pair):
    _matrix_case(family, k, batch, qwen, gemma4_pair, "inductor")


# ---- what a compiled graph runs differently -------------------------------------------------
def test_compiled_forms_equal_the_eager_ones(monkeypatch):
    """Under compilation the sparse experts are written as multiply + sum (fused loops in
    inductor's code): the same values as the eager form."""
    from mtpkit.kernels.moe_experts import moe_experts
    g = torch.Generator().manual_seed(0)
    T, K, E, H, I = 3, 2, 8, 16, 12
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64)
    down = torch.randn(E, I, H, generator=g, dtype=torch.float64)
    experts = torch.tensor([[1, 5], [5, 0], [7, 7]])
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    eager = moe_experts(x, w13, down, experts, weights)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(moe_experts(x, w13, down, experts, weights), eager, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (4, 20.0)])
def test_compiled_attention_form_equals_the_eager_one(monkeypatch, window, softcap):
    """Under compilation a one-query-per-row attention is written as multiply + sum
    (paged._attend_fused) instead of scaled_dot_product_attention: the same values, for grouped
    query heads, rows of different lengths, a sliding window and a logit softcap."""
    q_len = 1
    from mtpkit.kernels import paged
    g = torch.Generator().manual_seed(1)
    R, H, KVH, D, ctx = 3, 4, 2, 8, 11
    q = torch.randn(R, q_len, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(R, ctx, KVH, D, generator=g, dtype=torch.float64) for _ in range(2))
    seq_lens = torch.tensor([ctx, 7, q_len])
    q_pos = seq_lens[:, None] - q_len + torch.arange(q_len)
    eager = paged._attend(q, k, v, q_pos, 0.3, window, softcap)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(paged._attend(q, k, v, q_pos, 0.3, window, softcap), eager, rtol=1e-12, atol=1e-12)


def test_compiled_routing_equals_topk(monkeypatch):
    """Under compilation the router's top k is k argmax passes (moe.top_k_by_argmax): topk's values
    and experts, largest first."""
    from mtpkit.layers.moe import top_k_by_argmax
    probs = torch.softmax(torch.randn(6, 16, generator=torch.Generator().manual_seed(2)), -1)
    for k in (1, 2, 10):
        values, experts = top_k_by_argmax(probs, k)
        ref = torch.topk(probs, k, dim=-1)
        assert torch.equal(experts, ref.indices) and torch.equal(values, ref.values)


def test_compiled_one_token_steps_gather_their_experts(monkeypatch):
    """A compiled one-token step (a drafter's pass, a decode step) takes the sparse path at top 2
    of 8 experts; a bundle of 4 tokens and any traced or eager step stay dense."""
    moe = SparseMoE.__new__(SparseMoE)
    moe.num_experts, moe.num_local, moe.topk, moe.fp8, moe.ops = 8, 8, 2, None, None
    assert [moe._path(t) for t in (1, 4)] == ["dense", "dense"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert [moe._path(t) for t in (1, 2, 4)] == ["sparse", "sparse", "dense"]
