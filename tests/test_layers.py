"""Merged weight layouts and the MoE block's three paths.

- The loader's merged layouts (qkv_proj, GDN in_proj, MoE w_in / w13 / w_out, MLP gate_up)
  invert exactly: exporting a loaded checkpoint gives back every tensor of the file.
- SparseMoE's dense, sparse and grouped paths all equal a plain per-expert loop written the
  way the reference model computes it (router softmax, top-k, each expert's output times its
  weight, plus the gated shared expert), in row- and column-major weight layouts, and in the
  layout set_weight_layout gives them on CPU (w13 row-major when decode steps gather experts
  from it, column-major when every step multiplies all of it).
- PartialRoPE over the whole head equals rotate_half on the first rot_dim dims, bit for bit.
"""

import types
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mtpkit import LLM
from mtpkit.layers.rope import PartialRoPE
from mtpkit.checkpoint.loader import export_state_dict
from mtpkit.layers.layout import set_weight_layout
from mtpkit.layers.linear import linear
from mtpkit.layers.moe import SparseMoE
from mtpkit.checkpoint.hub import resolve_model
from mtpkit.parallel import TP


def test_export_inverts_loading_of_the_embedded_checkpoint():
    path = resolve_model("tiny-qwen3-next")
    llm = LLM(path, num_spec=2, dtype="bfloat16")  # the file's dtype: no rounding either way
    stored = load_file(path / "model.safetensors")
    exported = export_state_dict(llm.model)
    assert set(exported) == set(stored)
    for name, t in stored.items():
        assert torch.equal(exported[name], t), name


def _reference_moe(x, moe: SparseMoE, sd: dict) -> torch.Tensor:
    """Per token, per chosen expert, as transformers' Qwen3NextSparseMoeBlock computes it."""
    probs = torch.softmax(F.linear(x, sd["gate.weight"]), dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, moe.topk, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.topk):
            e = int(idx[t, j])
            g = F.linear(x[t], sd[f"experts.{e}.gate_proj.weight"])
            u = F.linear(x[t], sd[f"experts.{e}.up_proj.weight"])
            out[t] += w[t, j] * F.linear(F.silu(g) * u, sd[f"experts.{e}.down_proj.weight"])
    if moe.s:
        g = F.linear(x, sd["shared_expert.gate_proj.weight"])
        u = F.linear(x, sd["shared_expert.up_proj.weight"])
        shared = F.linear(F.silu(g) * u, sd["shared_expert.down_proj.weight"])
        out += torch.sigmoid(F.linear(x, sd["shared_expert_gate.weight"])) * shared
    return out


@pytest.mark.parametrize("shared", [0, 48])
@pytest.mark.parametrize("layout", ["row", "column", "cpu"])
def test_moe_paths_equal_the_per_expert_reference(shared, layout):
    torch.manual_seed(0)
    moe = SparseMoE(hidden=32, num_experts=16, topk=2, intermediate=24, shared_intermediate=shared,
                    norm_topk=True, tp=TP.single()).double()
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    if layout == "column":
        for p in (moe.w_in, moe.w_out):
            p.data = p.data.t().contiguous().t()
    if layout == "cpu":
        set_weight_layout(moe, torch.device("cpu"), lambda name: False)
        # 2 of 16 experts per token: decode steps gather w13's blocks, which stay row-major.
        assert moe.decode_gathers() and moe.w13.is_contiguous()
        assert moe.w_in.t().is_contiguous() and moe.w_out.t().is_contiguous()
    prefix = "mlp"
    sd = {name[len(prefix) + 1:]: t for spec in moe.checkpoint_specs(prefix)
          for name, t in spec.export(spec.param).items()}
    for T in (1, 3, 8):
        x = torch.randn(T, 32, dtype=torch.float64)
        h = F.linear(x, moe.w_in)
        ref = _reference_moe(x, moe, sd)
        for path in (moe._dense, moe._sparse, moe._grouped):
            torch.testing.assert_close(path(x, h), ref, rtol=1e-12, atol=1e-12, msg=path.__name__)
    # forward picks the gather path for a decode-sized step here (2 of 16 experts), the dense
    # one for a larger step: each other path is made to fail, and forward still matches.
    for T, other in ((1, "_dense"), (3, "_sparse")):
        x = torch.randn(T, 32, dtype=torch.float64)
        setattr(moe, other, lambda *a: pytest.fail(f"{other} ran for {T} tokens"))
        torch.testing.assert_close(moe(x), _reference_moe(x, moe, sd), rtol=1e-12, atol=1e-12)
        delattr(moe, other)


@pytest.mark.parametrize("shared", [0, 16])
def test_cpu_layout_merges_w_in_and_w13_when_every_step_runs_every_expert(shared):
    """8 experts, top 2: even a one-token step computes every expert (the dense path). On CPU
    w_in and w13 are then views of one column-major matrix and forward multiplies x by it
    once; the result equals the per-expert reference, the export is the checkpoint's."""
    torch.manual_seed(0)
    moe = SparseMoE(hidden=32, num_experts=8, topk=2, intermediate=24, shared_intermediate=shared,
                    norm_topk=True, tp=TP.single()).double()
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    before = {n: t.clone() for spec in moe.checkpoint_specs("mlp") for n, t in spec.export(spec.param).items()}
    set_weight_layout(moe, torch.device("cpu"), lambda name: False)
    assert not moe.decode_gathers() and moe._merged()
    assert moe.w_in13.t().is_contiguous() and moe.w13.view(-1, 32).stride(0) == 1   # column-major views
    after = {n: t for spec in moe.checkpoint_specs("mlp") for n, t in spec.export(spec.param).items()}
    assert all(torch.equal(after[n], t) for n, t in before.items())
    sd = {name[len("mlp") + 1:]: t for name, t in after.items()}
    calls = []
    moe._experts = lambda *a: calls.append(a) or pytest.fail("the unmerged path ran")
    for T in (1, 4):
        x = torch.randn(T, 32, dtype=torch.float64)
        torch.testing.assert_close(moe(x), _reference_moe(x, moe, sd), rtol=1e-12, atol=1e-12)
    del moe._experts
    # A prefill-sized step (16 pairs per expert on average: grouped_rows) loops over the experts
    # hit; one token fewer still computes every expert.
    for T, other in ((64, "_dense"), (63, "_grouped")):
        x = torch.randn(T, 32, dtype=torch.float64)
        setattr(moe, other, lambda *a: pytest.fail(f"{other} ran for {T} tokens"))
        torch.testing.assert_close(moe(x), _reference_moe(x, moe, sd), rtol=1e-12, atol=1e-12)
        delattr(moe, other)
    # Weights replaced after the merge (a reload, .to(...)): the merged matrix is not used.
    moe.w13.data = moe.w13.data.clone()
    assert not moe._merged()
    x = torch.randn(2, 32, dtype=torch.float64)
    torch.testing.assert_close(moe(x), _reference_moe(x, moe, sd), rtol=1e-12, atol=1e-12)


def test_rope_over_the_whole_head_is_rotate_half_on_the_rotated_dims():
    rope = PartialRoPE(head_dim=64, rot_dim=16, theta=10000.0)
    pos = torch.tensor([0, 1, 7, 100, 2047])
    x = torch.randn(5, 6, 64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))   # as transformers computes it
    freqs = pos[:, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    rot, rest = x[..., :16], x[..., 16:]
    rotated = torch.cat([-rot[..., 8:], rot[..., :8]], -1)
    expected = torch.cat([rot * cos + rotated * sin, rest], -1)
    assert torch.equal(rope(pos, x), expected)


@pytest.mark.parametrize("shared", [0, 16])
def test_grouped_path_of_tensor_parallel_shards_sums_to_the_whole(shared):
    """Under TP each rank loops over only its own experts' pairs (a contiguous run of the pairs
    sorted by expert) and its part of the shared expert: the ranks' partial sums (what the
    all-reduce adds) equal one rank's whole, and each rank's grouped result equals its dense one."""
    torch.manual_seed(0)
    full = SparseMoE(hidden=32, num_experts=8, topk=2, intermediate=24, shared_intermediate=shared,
                     norm_topk=True, tp=TP.single()).double()
    for p in full.parameters():
        p.data.normal_(0, 0.2)
    tensors = {n: t for spec in full.checkpoint_specs("mlp") for n, t in spec.export(spec.param).items()}
    shards = []
    for rank in range(2):
        m = SparseMoE(hidden=32, num_experts=8, topk=2, intermediate=24, shared_intermediate=shared,
                      norm_topk=True, tp=TP(rank=rank, size=2)).double()
        for spec in m.checkpoint_specs("mlp"):
            spec.param.data = spec.assemble({n: tensors[n] for n in spec.sources}).double()
        shards.append(m)
    x = torch.randn(40, 32, dtype=torch.float64)
    whole = full._grouped(x, full.project_in(x))
    parts = [m._grouped(x, m.project_in(x)) for m in shards]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-12)
    for m, part in zip(shards, parts):
        torch.testing.assert_close(part, m._dense(x, m.project_in(x)), rtol=1e-12, atol=1e-12)
    assert shards[1].first == 4 and parts[0].abs().sum() > 0 and parts[1].abs().sum() > 0
    # Every token routed to experts 0-3 (rank 0's): rank 1 has no pair, only its shared part.
    for m in (full, *shards):
        m.w_in.data[:4] = 1.0
        m.w_in.data[4:8] = 0.0
    x = torch.rand(40, 32, dtype=torch.float64) + 0.1
    parts = [m._grouped(x, m.project_in(x)) for m in shards]
    torch.testing.assert_close(parts[0] + parts[1], full._grouped(x, full.project_in(x)), rtol=1e-12, atol=1e-12)
    m = shards[1]
    shared_only = linear(m._shared_act(m.project_in(x)), m.w_out[:, :m.shared_range[1]]) if shared else 0
    torch.testing.assert_close(parts[1], torch.zeros_like(x) + shared_only, rtol=1e-12, atol=1e-12)


def test_grouped_rows_rule_leaves_a_fused_backend_on_its_kernel():
    """The many-rows rule (grouped_rows) was measured against the torch dense path on CPU; a
    fused expert kernel reads each touched expert once, so a 64-token step stays on it, and only
    the old many-pairs rule (dense_limit) sends larger steps to the loop."""
    moe = SparseMoE(hidden=32, num_experts=8, topk=2, intermediate=24, shared_intermediate=0,
                    norm_topk=True, tp=TP.single())
    assert [moe._path(T) for T in (63, 64, 129)] == ["dense", "grouped", "grouped"]
    moe.ops = types.SimpleNamespace(fused_moe=True)
    assert [moe._path(T) for T in (63, 64, 128, 129)] == ["sparse", "sparse", "sparse", "grouped"]
