"""The fused MoE Triton kernel (mtpkit/kernels/triton_moe.py) against its torch reference
(moe_experts.py), under the Triton interpreter on CPU (MTPKIT_TRITON_TEST_DEVICE=cuda: natively).

Routings cover tokens per expert 0..bundle (every token of a bundle on one expert, each on its
own), distinct experts per token 1..top_k (a token repeating an expert with weight 0 is what a
tensor-parallel rank's stand-in for another rank's expert looks like), padded rows (expert 0,
weight 0), sizes that are not multiples of the tiles, and w_down as the model's strided view.
"""

import importlib
import os

DEVICE = "cuda" if os.environ.get("MTPKIT_TRITON_TEST_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before mtpkit.kernels.triton_moe is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from mtpkit.kernels import moe_experts as ref  # noqa: E402

pytest.importorskip("triton")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("MTPKIT_TRITON_TEST_DEVICE=cuda but CUDA is not available", allow_module_level=True)

E, I, H = 8, 40, 80     # I, H: not multiples of the tiles (32, 64)


@pytest.fixture(scope="module")
def kernel():
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module("mtpkit.kernels.triton_moe")
    if DEVICE == "cpu" and not isinstance(mod._moe_gate_up_kernel, InterpretedFunction):
        mod = importlib.reload(mod)
    assert (DEVICE == "cuda") != isinstance(mod._moe_gate_up_kernel, InterpretedFunction)
    return mod


def weights_of(g, dtype, strided):
    w13 = torch.randn(E, 2 * I, H, generator=g).to(dtype).to(DEVICE) * 0.2
    if strided:  # SparseMoE's views; on CPU both matrices column-major (set_weight_layout)
        w13 = w13.reshape(-1, H).t().contiguous().t().view(E, 2 * I, H)
        S = 16
        w_out = torch.randn(H, S + E * I, generator=g).to(dtype).to(DEVICE) * 0.2
        w_out = w_out.t().contiguous().t() if DEVICE == "cpu" else w_out
        return w13, w_out[:, S:].T.view(E, I, H)
    return w13, (torch.randn(E, I, H, generator=g) * 0.2).to(dtype).to(DEVICE)


def routing(kind, T, K, g):
    """(experts [T, K], weights [T, K]) of one routing pattern."""
    if kind == "same":            # every token on the same K experts: K runs of T tokens
        experts = torch.arange(K).repeat(T, 1)
    elif kind == "spread":        # distinct experts per token, runs of 0..few tokens
        experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    elif kind == "repeat":        # 1..K distinct experts per token, repeats with weight 0
        experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        for t in range(T):
            distinct = 1 + t % K
            experts[t, distinct:] = experts[t, 0]
    else:                         # "padded": the last rows are inert (expert 0, weight 0)
        experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g) + 0.1
    if kind == "repeat":
        for t in range(T):
            weights[t, 1 + t % K:] = 0.0
    if kind == "padded":
        experts[T // 2:] = 0
        weights[T // 2:] = 0.0
    return experts.to(DEVICE), weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K", [(1, 1), (1, 4), (4, 2), (12, 3)])    # T: batch x bundle
@pytest.mark.parametrize("kind", ["same", "spread", "repeat", "padded"])
def test_fused_moe_matches_reference(kernel, dtype, T, K, kind):
    g = torch.Generator().manual_seed(T * 100 + K)
    w13, w_down = weights_of(g, dtype, strided=kind != "spread")
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    experts, weights = routing(kind, T, K, g)
    weights = weights.to(dtype).to(DEVICE)
    got = kernel.moe_experts(x, w13, w_down, experts, weights)
    # The reference in fp64 from the same (rounded) inputs: the kernel accumulates in fp32.
    want = ref.moe_experts(x.double(), w13.double(), w_down.double(), experts, weights.double())
    assert got.dtype == dtype and got.shape == (T, H)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    if kind == "padded":
        assert torch.all(got[T // 2:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,kind", [(4, 2, "spread"), (12, 3, "repeat"), (70, 2, "same")])
def test_fused_moe_gelu_tanh_and_runs_longer_than_a_tile(kernel, dtype, T, K, kind):
    """Gemma 4's experts (act gelu_tanh) against the reference; 70 tokens on the same experts
    make runs longer than the kernel's 64-token tile (two passes over one expert)."""
    g = torch.Generator().manual_seed(T * 10 + K)
    w13, w_down = weights_of(g, dtype, strided=True)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    experts, weights = routing(kind, T, K, g)
    weights = weights.to(dtype).to(DEVICE)
    act = "gelu_tanh" if T < 70 else "silu"
    got = kernel.moe_experts(x, w13, w_down, experts, weights, act)
    want = ref.moe_experts(x.double(), w13.double(), w_down.double(), experts, weights.double(), act)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    if T == 70:  # the same for gelu_tanh over the long runs
        got = kernel.moe_experts(x, w13, w_down, experts, weights, "gelu_tanh")
        want = ref.moe_experts(x.double(), w13.double(), w_down.double(), experts, weights.double(), "gelu_tanh")
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_a_fused_backend_gathers_where_the_torch_one_computes_every_expert(kernel, act):
    """A step of 8 tokens x top 4 of 16 experts: the torch backend computes every expert
    (gathering each pair's expert would copy more than the weights), a backend whose
    moe_experts reads each touched expert once (fused_moe) runs it on the sparse path (8 x 16
    is below dense_limit: no grouped loop, as in a captured step); the same output."""
    import dataclasses

    from mtpkit.kernels.ops import TORCH
    from mtpkit.layers.moe import SparseMoE
    from mtpkit.parallel import TP

    torch.manual_seed(0)
    ran = []

    def counted(*a, _fn=kernel.moe_experts):
        ran.append(a[-1])
        return _fn(*a)
    fused = dataclasses.replace(TORCH, moe_experts=counted, fused_moe=True)
    outs = {}
    for name, ops in (("torch", TORCH), ("fused", fused)):
        moe = SparseMoE(hidden=32, num_experts=16, topk=4, intermediate=24, shared_intermediate=16,
                        norm_topk=True, tp=TP.single(), ops=ops)
        moe.act = act
        for prm in moe.parameters():
            prm.data = torch.randn(prm.shape, generator=torch.Generator().manual_seed(prm.numel())) * 0.3
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
        paths = []
        for path in ("_dense", "_sparse"):
            fn = getattr(moe, path)
            setattr(moe, path, lambda *a, _fn=fn, _p=path: paths.append(_p) or _fn(*a))
        with torch.no_grad():
            outs[name] = moe(x)
        assert paths == (["_dense"] if name == "torch" else ["_sparse"]), (name, paths)
    assert ran == [act]
    torch.testing.assert_close(outs["fused"], outs["torch"], atol=1e-4, rtol=1e-4)


def test_fp64_goes_to_the_reference(kernel):
    g = torch.Generator().manual_seed(0)
    w13, w_down = weights_of(g, torch.float64, strided=False)
    x = torch.randn(3, H, generator=g, dtype=torch.float64).to(DEVICE)
    experts, weights = routing("spread", 3, 2, g)
    weights = weights.double().to(DEVICE)
    assert torch.equal(kernel.moe_experts(x, w13, w_down, experts, weights),
                       ref.moe_experts(x, w13, w_down, experts, weights))


def test_engine_with_the_fused_moe_gives_the_torch_backends_tokens(kernel, tmp_path):
    """The Triton backend's engine (attention-side kernels and the fused MoE, interpreted) gives
    the torch backend's greedy tokens, MTP on; the fused kernel really ran on the sparse path
    (64 experts, top 2: a step of 2 requests x bundle 2 gathers its experts)."""
    if DEVICE != "cpu":
        pytest.skip("runs the interpreter")
    import dataclasses
    import json

    import mtpkit
    from mtpkit import SamplingParams
    from mtpkit.layers.moe import SparseMoE

    cfg = dict(model_type="qwen3_next", vocab_size=96, hidden_size=32, num_hidden_layers=2,
               full_attention_interval=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               num_experts=64, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=256,
               rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
               tie_word_embeddings=False, eos_token_id=0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = [[5, 9, 17, 3], [40, 2, 2, 71, 8, 13]]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    runs, logits = {}, {}
    for backend in ("torch", "triton"):
        llm = mtpkit.LLM(tmp_path, load_format="dummy", dtype="float32", num_spec=1, attn_backend=backend,
                         max_num_seqs=2, max_model_len=64, graph_sizes=[1, 2], seed=1)
        calls = []
        for m in llm.model.modules():
            if isinstance(m, SparseMoE):
                with torch.no_grad():  # std 0.02 would leave the experts' share of the logits ~1e-6
                    m.w13.mul_(20)
                    m.w_out.mul_(20)
                fn = m.ops.moe_experts

                def counted(*a, _fn=fn):
                    calls.append(_fn)
                    return _fn(*a)
                m.ops = dataclasses.replace(m.ops, moe_experts=counted)
        runs[backend] = [o.token_ids for o in llm.generate(prompts, sp)]
        # The last verify step's logits (same tokens in, so the same step): a 1% error in the
        # fused kernel moves them ~6e-5, where the backends differ by ~1e-7.
        logits[backend] = llm.runner.graphs.outputs[2]["logits"].clone()
        assert calls and all(f is (kernel.moe_experts if backend == "triton" else ref.moe_experts) for f in calls)
    assert runs["triton"] == runs["torch"]
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=2e-6, rtol=1e-5)
