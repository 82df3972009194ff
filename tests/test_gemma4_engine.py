"""Gemma 4 through the engine's other paths, against the eager torch path (itself checked
against transformers in test_gemma4_parity.py): CPU graphs (traced verify steps) == eager,
tensor parallelism on two gloo processes == one process (heads split, the full layers' one
KV head replicated, experts split, per-layer embeddings vocab-parallel), float64."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_oracle as G  # noqa: E402
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

from mtpkit import LLM, SamplingParams  # noqa: E402

# accelerate's launchers meet on a fixed port: this file takes turns with the others that start them (conftest)
pytestmark = pytest.mark.fixed_port

NAMES = ("dense", "moe", "e2b")
F64 = dict(dtype="float64", device="cpu", max_model_len=96, max_num_seqs=3, max_num_batched_tokens=16)
PROMPT_LENS = (1, 9, 30)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_engine")
    for name in NAMES:
        G.save(G.build_hf(name), root / name)
    return root


def _prompts():
    return [O.random_prompt(n, 128, seed=40 + n) for n in PROMPT_LENS]


def _run(path, **kw):
    llm = LLM(path, **F64, **kw)
    if llm.runner.graphs is not None:
        llm.runner.graphs.trace_after = 0       # trace from the first decode step
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=20, ignore_eos=True))
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("name", NAMES)
def test_graphs_equal_eager(checkpoints, name):
    eager, _ = _run(checkpoints / name, enforce_eager=True)
    graphs, llm = _run(checkpoints / name, enforce_eager=False)
    assert llm.runner.graphs.verify_graphs, "the decode steps were meant to run as traced graphs"
    assert graphs == eager


def _tp2_worker(root: str):
    from accelerate import PartialState
    state = PartialState(cpu=True)
    torch.set_num_threads(1)
    out = {}
    for name in NAMES:
        llm = LLM(Path(root) / name, tensor_parallel_size=2, enforce_eager=True, **F64)
        outs = llm.generate(_prompts(), SamplingParams(max_tokens=20, ignore_eos=True))
        full = next(layer.self_attn for layer in llm.model.layers if layer.self_attn.window is None)
        out[name] = dict(tokens=[o.token_ids for o in outs], logits=llm.score(_prompts()[2]),
                         heads=full.heads, kv_heads=full.kv_heads,
                         experts=getattr(llm.model.layers[0], "experts", None) and llm.model.layers[0].experts.num_local)
    torch.save(out, Path(root) / f"rank{state.process_index}.pt")


@pytest.fixture(scope="module")
def tp2(checkpoints):
    from accelerate import debug_launcher
    debug_launcher(_tp2_worker, args=(str(checkpoints),), num_processes=2)
    return [torch.load(checkpoints / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", NAMES)
def test_tp2_equals_tp1(checkpoints, tp2, name):
    tokens, llm = _run(checkpoints / name, enforce_eager=True)
    logits = llm.score(_prompts()[2])
    r0, r1 = tp2[0][name], tp2[1][name]
    assert r0["tokens"] == r1["tokens"] == tokens
    assert torch.equal(r0["logits"], r1["logits"])
    diff = (r0["logits"] - logits).abs().max().item()
    assert diff < 1e-9, f"TP=2 vs TP=1 logits differ by {diff:.3g}"
    assert r0["heads"] == 2                       # 4 query heads split
    if name == "dense":
        assert r0["kv_heads"] == 1                # the full layers' single KV head, replicated
    if name == "moe":
        assert r0["experts"] == 4                 # 8 experts, whole experts per rank


def test_preemption_sampling_streaming_and_debug_mode(checkpoints):
    """On the E2B-like model (per-layer embeddings, KV-shared layers): a KV pool that holds two
    sequences at most preempts and recomputes without changing greedy or seeded sampled output;
    streaming yields the generated tokens; debug mode checks every typed boundary and gives the
    same tokens."""
    import mtpkit
    path = checkpoints / "e2b"
    prompts = [O.random_prompt(30 + i, 128, seed=60 + i) for i in range(4)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=5)
    big = LLM(path, dtype="float64", device="cpu", max_model_len=64, max_num_seqs=4)
    modes = {"greedy": greedy, "sampled": sampled}
    ref = {m: [o.token_ids for o in big.generate(prompts, p)] for m, p in modes.items()}
    tight = LLM(path, dtype="float64", device="cpu", max_model_len=64, max_num_seqs=4, num_blocks=1 + 4 + 2)
    for m, p in modes.items():
        outs = tight.generate(prompts, p)
        assert [o.token_ids for o in outs] == ref[m], m
        assert sum(o.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    assert ref["sampled"] != ref["greedy"]
    streamed = {}
    for ev in big.stream(prompts[:2], greedy):
        streamed.setdefault(ev.index, []).extend(ev.new_token_ids)
    assert [streamed[0], streamed[1]] == ref["greedy"][:2]
    with mtpkit.debug() as trace:
        dbg = LLM(path, dtype="float64", device="cpu", max_model_len=64, max_num_seqs=4)
        assert [o.token_ids for o in dbg.generate(prompts[:2], greedy)] == ref["greedy"][:2]
    called = set(trace.functions())
    assert {"per_layer_inputs", "compute_logits"} <= {f.rsplit(".", 1)[-1] for f in called}, sorted(called)


@pytest.mark.parametrize("name", NAMES)
def test_captured_prefill_equals_eager(checkpoints, name):
    """One prompt per call: every prefill step holds one chunk and replays the traced prefill
    (CapturedSteps.prefill: the chunk padded at its end to 16 tokens, a uniform step of one row
    through the sliding and full attention, MoE, per-layer inputs, shared KV), the 30-token
    prompt as 16 + 14 (the second chunk attends over the first's KV)."""
    from mtpkit.shapes import is_debug

    def run(**kw):
        llm = LLM(checkpoints / name, **F64, **kw)
        if llm.runner.graphs is not None:
            llm.runner.graphs.trace_after = 0
        sp = SamplingParams(max_tokens=8, ignore_eos=True)
        return [llm.generate([p], sp)[0].token_ids for p in _prompts()], llm
    eager, _ = run(enforce_eager=True)
    graphs, llm = run()
    assert graphs == eager
    assert sorted(llm.runner.graphs.prefill_graphs) == ([] if is_debug() else [(16, 64, 0)])
