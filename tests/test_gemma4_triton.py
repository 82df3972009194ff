"""Gemma 4 with the Triton attention backend, on CPU under the Triton interpreter: the same
greedy tokens as the torch backend. The kernels see sliding windows (4 keys) shorter than
the prompts, two head dims (16 sliding, 32 full), attention scale 1, a KV-shared layer
reading another layer's cache, chunked prefill and padded verify rows (3 prompts in
graph sizes 1, 2, 4), and blocks of 4 tokens, so the sliding pool returns blocks below the
window as the requests advance (the kernels must start at the window: freed table entries
are the null block)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before mtpkit's Triton kernel modules are imported

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_oracle as G  # noqa: E402
import oracle as O  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("transformers")

S, F = G.S, G.F
# dense geometry (k_eq_v, full layers head_dim 32 / 1 KV head) plus one KV-shared layer.
CFG = dict(G.CONFIGS["dense"], num_hidden_layers=4, layer_types=[S, F, S, F], sliding_window=4,
           num_kv_shared_layers=1)
PROMPT_LENS = (5, 11, 3)


def _checkpoint(tmp_path_factory, cfg):
    G.CONFIGS["triton"] = cfg
    try:
        model = G.build_hf("triton")
    finally:
        del G.CONFIGS["triton"]
    path = tmp_path_factory.mktemp("gemma4_triton")
    G.save(model.to(torch.float32), path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, CFG)


def _generate(path, backend, on_llm=lambda llm: None, prompt_lens=PROMPT_LENS, max_tokens=10,
              recycled=True):
    """Greedy tokens and every logits row the run computed (prefill and verify steps)."""
    import mtpkit
    llm = mtpkit.LLM(path, dtype="float32", device="cpu", attn_backend=backend, max_num_seqs=4, max_model_len=64,
                     max_num_batched_tokens=8, graph_sizes=[1, 2, 4], block_size=4)
    assert llm.model.layers[0].self_attn.ops.name == backend
    captured, orig = [], llm.model.compute_logits
    llm.model.compute_logits = lambda h: captured.append(orig(h)) or captured[-1]
    prompts = [O.random_prompt(n, 128, seed=n) for n in prompt_lens]
    sliding, freed = llm.kv_pools["sliding_4"], []
    orig_free = sliding.free
    sliding.free = lambda blocks: freed.extend(blocks) or orig_free(blocks)
    on_llm(llm)
    outs = llm.generate(prompts, mtpkit.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert not recycled or len(freed) > sliding.num_blocks, "blocks were meant to be recycled while the requests ran"
    return [o.token_ids for o in outs], captured


def test_triton_backend_matches_torch_greedy(checkpoint):
    tokens, logits = _generate(checkpoint, "triton")
    ref_tokens, ref_logits = _generate(checkpoint, "torch")
    assert tokens == ref_tokens
    # The same schedule, so the same logits rows, equal to fp32 rounding (a window one key
    # too wide moves them by ~1e-1 of the scale).
    assert [x.shape for x in logits] == [x.shape for x in ref_logits]
    for got, want in zip(logits, ref_logits):
        assert ((got - want).abs().amax(-1) / want.abs().amax(-1)).max() < 1e-4


def test_moe_variant_runs_the_fused_experts_with_gelu_tanh(tmp_path_factory):
    """The MoE variant (8 experts, top 2, gelu-tanh experts): the torch backend computes every
    expert for a step's tokens, the Triton backend gathers the chosen ones through its fused
    kernel (act gelu_tanh) at every step; the same greedy tokens and logits."""
    import dataclasses

    from mtpkit.models.gemma4.model import Gemma4Experts

    path = _checkpoint(tmp_path_factory, dict(G.CONFIGS["moe"], sliding_window=4))
    acts = []

    def count(llm):
        for m in llm.model.modules():
            if isinstance(m, Gemma4Experts):
                fn = m.ops.moe_experts
                m.ops = dataclasses.replace(m.ops, moe_experts=lambda *a, _fn=fn: acts.append(a[-1]) or _fn(*a))
    short = dict(prompt_lens=(11, 3), max_tokens=6, recycled=False)   # the experts are the point here
    tokens, logits = _generate(path, "triton", count, **short)
    assert acts and set(acts) == {"gelu_tanh"}
    n = len(acts)
    ref_tokens, ref_logits = _generate(path, "torch", count, **short)
    assert len(acts) == n, "the torch backend computes every expert at these sizes"
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert ((got - want).abs().amax(-1) / want.abs().amax(-1)).max() < 1e-4
