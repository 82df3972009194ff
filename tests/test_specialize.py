"""graphs.specialize: a traced graph folded to its one shape computes exactly what it did."""

import warnings

import torch

from mtpkit import LLM, SamplingParams
from mtpkit.graphs.specialize import specialized


def _trace(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.trace(fn, args, check_trace=False)


def _kinds(fn) -> list[str]:
    return [n.kind() for n in fn.graph.nodes()]


def _body(x, y, out):
    n, d = x.shape[0], x.shape[1]
    z = x.view(n, d)[:, :]                       # identity view, full slice
    w = z[:, 2:5] * y[:n, :3]                    # partial slices stay
    out[:, :].add_(w.reshape(n, 3).sum(-1, keepdim=True))  # in place through a full slice
    return torch.cat([w, x[:, : x.shape[1] - 3]], 1).reshape(n * 2, -1)


def test_sizes_folded_identities_dropped_results_equal():
    x, y = torch.randn(4, 6), torch.randn(5, 3)
    traced = _trace(_body, x, y, torch.zeros(4, 1))
    spec = specialized(traced, "body")
    before, after = _kinds(traced), _kinds(spec)
    assert before.count("aten::size") > 0 and after.count("aten::size") == 0
    assert after.count("aten::slice") < before.count("aten::slice")
    assert after.count("aten::view") < before.count("aten::view")
    for seed in range(3):  # new values, the traced shape
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 6, generator=g), torch.randn(5, 3, generator=g)
        out_a, out_b = torch.zeros(4, 1), torch.zeros(4, 1)
        ref = _body(x, y, out_a)
        got = spec(x, y, out_b)
        assert torch.equal(got, ref)
        assert torch.equal(out_b, out_a) and out_b.abs().sum() > 0  # the in-place write landed


def test_engine_graphs_have_no_shape_bookkeeping_and_match_eager():
    prompts = [list(b"def fibonacci(n):\n"), list(b"import os\n")]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = LLM("tiny-qwen3-next", num_spec=2, dtype="float32", enforce_eager=True).generate(prompts, sp)
    llm = LLM("tiny-qwen3-next", num_spec=2, dtype="float32")
    llm.runner.graphs.trace_after = 0
    traced = llm.generate(prompts, sp)
    assert [o.token_ids for o in traced] == [o.token_ids for o in eager]
    g = llm.runner.graphs
    assert g.verify_graphs and g.propose_graphs
    for fn in list(g.verify_graphs.values()) + list(g.propose_graphs.values()):
        assert "aten::size" not in _kinds(fn)
