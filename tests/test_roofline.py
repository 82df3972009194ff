"""benchmarks/roofline.py: its byte counts against a hand count, and the routing it records."""

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import roofline  # noqa: E402

# Two layers: 0 is GDN, 1 full attention; both MoE. Every size distinct enough that a wrong
# factor shows.
CFG = dict(model_type="qwen3_next", vocab_size=128, hidden_size=32, num_hidden_layers=2,
           full_attention_interval=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
           intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1,
           mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=512,
           rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
           tie_word_embeddings=False, eos_token_id=0, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("roof")
    (path / "config.json").write_text(json.dumps(CFG))
    return roofline.build(path, Namespace(num_spec=2, dtype="float32", batch=2, context=10, threads=1), "cpu")


def test_step_bytes_equal_a_hand_count(llm):
    b, k, c = 2, 2, 10
    B, T = k + 1, 2 * 3
    # Fixed routing: layer 0's six tokens choose experts {0, 1, 2, 5}, layer 1's {3}; the MTP
    # layer's two rows choose {0, 7} in pass 1 and {4, 6, 7} in pass 2 (each counted once).
    routing = {"layers.0.mlp": [torch.tensor([[0, 1], [1, 2], [0, 5], [5, 0], [1, 2], [2, 0]])],
               "layers.1.mlp": [torch.tensor([[3, 3]] * 6)],
               "mtp.layers.0.mlp": [torch.tensor([[0, 7], [7, 0]]), torch.tensor([[4, 6], [7, 4]])]}
    got = roofline.step_bytes(llm.model, llm.model.cfg, roofline.Step(b, k, c), routing)
    f = 4  # float32
    # Non-expert weights, in parameters. GDN layer: in_proj rows q, k (2*8 each), v, z (4*8
    # each), b, a (4 each) times hidden 32; conv weight 64 channels x 4; A_log, dt_bias 4 each;
    # gated norm 8; out_proj 32 x 32.
    gdn = (16 + 16 + 32 + 32 + 4 + 4) * 32 + 64 * 4 + 4 + 4 + 8 + 32 * 32
    # Attention: q, gate (2 heads x 16 each), k, v (1 head x 16 each) rows x 32; o_proj 32 x 32;
    # q and k norms 16 each.
    attn = (32 + 32 + 16 + 16) * 32 + 32 * 32 + 16 + 16
    # MoE without its experts: router (8) + shared gate (1) + shared gate/up (16 + 16) rows x 32,
    # and the shared expert's down columns 32 x 16.
    moe = (8 + 1 + 32) * 32 + 32 * 16
    norms = 2 * 32
    target = gdn + attn + 2 * (moe + norms) + 32                      # + the final norm
    mtp_layer = 2 * 32 + 2 * 32 * 32 + attn + moe + norms + 32        # pre-fc norms, fc, layer, norm
    expert = 3 * 16 * 32                                              # gate + up [2*16, 32], down [32, 16]
    kv = 2 * 1 * 16                                                   # K and V of one position
    ssm = 4 * 8 * 8                                                   # fp32 like float32 here
    want = {
        "weights": target * f,
        "experts": (4 + 1) * expert * f,
        "embedding": T * 32 * f,
        "lm_head": 128 * 32 * f,
        "kv read": b * (c + B) * kv * f,
        "kv written": T * kv * f,
        "gdn state read": b * ssm * f,
        "gdn state written": T * ssm * f,
        "conv state read": b * 64 * 3 * f,
        "conv state written": b * 64 * (3 + k) * f,
        "mtp weights": k * mtp_layer * f,
        "mtp experts": (2 + 3) * expert * f,
        "mtp embedding": (T + b) * 32 * f,
        "mtp lm_head": k * 128 * 32 * f,
        "mtp kv written": (T + b) * kv * f,
        "mtp kv read": (b * (c + 1) + b * (c + 2)) * kv * f,
    }
    assert got == want


def test_step_bytes_refuses_missing_routing(llm):
    with pytest.raises(ValueError, match="mtp.layers.0.mlp: 1 calls recorded, the step makes 2"):
        roofline.step_bytes(llm.model, llm.model.cfg, roofline.Step(2, 2, 10),
                            {"layers.0.mlp": [torch.zeros(6, 2, dtype=torch.int64)],
                             "layers.1.mlp": [torch.zeros(6, 2, dtype=torch.int64)],
                             "mtp.layers.0.mlp": [torch.zeros(2, 2, dtype=torch.int64)]})


def test_recorded_routing_covers_every_pass_and_only_real_rows(llm):
    """A steady verify step with its proposal: each target MoE routes the bundle's 6 real
    tokens once, the MTP layer routes the 2 rows once per pass; the recorded ids are the
    experts the step's own route chose."""
    g = roofline.steady_step(llm, Namespace(batch=2, context=10))
    verify, propose, state = roofline.body_calls(g, 2)
    with torch.inference_mode(), roofline.record_routing(llm.model, 2, g._last.num_reqs_padded) as routing:
        verify()
        propose()
    assert sorted(routing) == ["layers.0.mlp", "layers.1.mlp", "mtp.layers.0.mlp"]
    assert [r.shape for r in routing["layers.0.mlp"]] == [(6, 2)]
    assert [r.shape for r in routing["mtp.layers.0.mlp"]] == [(2, 2), (2, 2)]
    assert all(r.max() < 8 and r.min() >= 0 for rs in routing.values() for r in rs)
    assert "route" not in vars(llm.model.layers[0].mlp)   # the patch is gone afterwards
    # Rows past num_reqs are padding: with 1 real request of 2 rows, its 3 tokens and 1 row stay.
    with torch.inference_mode(), roofline.record_routing(llm.model, 1, 2) as routing:
        verify()
        propose()
    assert [r.shape for r in routing["layers.1.mlp"]] == [(3, 2)]
    assert [r.shape for r in routing["mtp.layers.0.mlp"]] == [(1, 2), (1, 2)]


# ---- Gemma 4 ---------------------------------------------------------------------------------
import roofline_bytes  # noqa: E402
import roofline_configs  # noqa: E402

S, F = "sliding_attention", "full_attention"
# Dense, with per-layer embeddings (Dp 4) and KV sharing: layers 0, 1 sliding (kv 2 x hd 8),
# 2 full (kv 1 x hd 32), 3 sliding and 4 full KV-shared (reading layers 1 and 2). Window 4.
G_DENSE = dict(model_type="gemma4_text", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=5,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_types=[S, S, F, S, F],
               per_layer_config={"2": {"head_dim": 32, "num_key_value_heads": 1},
                                 "4": {"head_dim": 32, "num_key_value_heads": 1}},
               sliding_window=4, num_kv_shared_layers=2, hidden_size_per_layer_input=4, vocab_size_per_layer_input=64,
               final_logit_softcapping=30.0, tie_word_embeddings=True, max_position_embeddings=512, eos_token_id=0)
# MoE beside the dense MLP (26B-A4B-like): 8 experts of 12, top 2; sliding kv 2 x hd 4, full
# layers k_eq_v with the global kv 1 x hd 16.
G_MOE = dict(model_type="gemma4_text", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=4, global_head_dim=16,
             num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F], sliding_window=4,
             enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=12,
             hidden_size_per_layer_input=0, final_logit_softcapping=30.0, tie_word_embeddings=True,
             max_position_embeddings=512, eos_token_id=0)
# Assistants of hidden 8, MLP 24, one sliding and one full layer; the MoE target's with the
# centroid head (8 clusters of 8 tokens, top 2).
A_SIZES = dict(hidden_size=8, intermediate_size=24, num_hidden_layers=2, num_centroids=8, centroid_intermediate_top_k=2)


def _gemma_llm(tmp_path_factory, cfg, ordered):
    path = tmp_path_factory.mktemp("g4")
    (path / "t").mkdir()
    (path / "a").mkdir()
    (path / "t" / "config.json").write_text(json.dumps(cfg))
    (path / "a" / "config.json").write_text(json.dumps(
        roofline_configs.assistant_config(cfg, **A_SIZES, use_ordered_embeddings=ordered)))
    return roofline.build(path / "t", Namespace(num_spec=2, dtype="float32", batch=2, context=10, threads=1), "cpu",
                          path / "a")


@pytest.fixture(scope="module")
def g_dense(tmp_path_factory):
    return _gemma_llm(tmp_path_factory, G_DENSE, ordered=False)


@pytest.fixture(scope="module")
def g_moe(tmp_path_factory):
    return _gemma_llm(tmp_path_factory, G_MOE, ordered=True)


f = 4        # float32
b, c = 2, 10


def _assistant_weights(kinds):
    """Hand count of an assistant of A_SIZES: per layer q_proj [heads * hd, 8], q_norm hd,
    o_proj [8, heads * hd], MLP gate/up [48, 8] and down [8, 24], 4 norms of 8, layer_scalar;
    then its norm, pre_projection [8, 2 * 16], post_projection [16, 8]."""
    layers = sum(2 * 4 * hd * 8 + hd + 48 * 8 + 8 * 24 + 4 * 8 + 1 for hd in kinds)
    return layers + 8 + 8 * 32 + 16 * 8


def test_gemma4_dense_step_bytes_equal_a_hand_count(g_dense):
    model, assistant = g_dense.model, g_dense.drafter.assistant
    # Per layer: MLP gate/up [64, 16] + down [16, 32], 4 norms of 16, layer_scalar, the
    # per-layer-embedding block (gate [4, 16], projection [16, 4], its norm 16).
    common = 64 * 16 + 16 * 32 + 4 * 16 + 1 + 4 * 16 + 16 * 4 + 16
    sliding = (32 + 16 + 16) * 16 + 16 * 32 + 8 + 8          # q, k, v rows x 16; o_proj; q/k norms
    full = (128 + 32 + 32) * 16 + 16 * 128 + 32 + 32
    shared_sliding = 32 * 16 + 16 * 32 + 8                   # q_proj, o_proj, q_norm
    shared_full = 128 * 16 + 16 * 128 + 32
    # + the per-layer-embedding projection [20, 16] and its norm 4, the final norm 16
    target = 2 * sliding + full + shared_sliding + shared_full + 5 * common + 20 * 16 + 4 + 16
    kv_s, kv_f = 2 * 2 * 8, 2 * 1 * 32                          # K and V of one position
    for k in (0, 2):
        B, T = k + 1, b * (k + 1)
        got = roofline.step_bytes(model, model.cfg, roofline.Step(b, k, c), {}, assistant if k else None)
        # Sliding layers 0, 1, 3 read min(c + B, W - 1 + B) positions, full layers 2, 4 read
        # c + B; only the non-shared layers 0, 1, 2 write.
        want = {"weights": target * f, "embedding": T * 16 * f, "per-layer embedding": T * 5 * 4 * f,
                "lm_head": 64 * 16 * f,
                "kv read": b * (3 * min(c + B, 3 + B) * kv_s + 2 * (c + B) * kv_f) * f,
                "kv written": T * (2 * kv_s + kv_f) * f}
        if k:
            # Round position p = c + 1: full reads p keys, sliding min(p, W + 1), per step.
            want |= {"drafter weights": k * _assistant_weights([8, 32]) * f, "drafter embedding": k * b * 16 * f,
                     "drafter lm_head": k * 64 * 8 * f,
                     "drafter kv read": k * b * (min(c + 1, 5) * kv_s + (c + 1) * kv_f) * f}
        assert got == want, k


def test_gemma4_moe_step_bytes_equal_a_hand_count(g_moe):
    model, assistant = g_moe.model, g_moe.drafter.assistant
    # Per layer: dense MLP, 7 norms of 16, layer_scalar, router.scale 16 and its proj [8, 16].
    common = 64 * 16 + 16 * 32 + 7 * 16 + 1 + 16 + 8 * 16
    sliding = (16 + 8 + 8) * 16 + 16 * 16 + 4 + 4
    full = (64 + 16) * 16 + 16 * 64 + 16 + 16                   # k_eq_v: no v_proj
    target = 2 * sliding + full + 3 * common + 16
    expert = 3 * 12 * 16 + 1                                    # gate/up [24, 16], down [16, 12], its scale
    kv_s, kv_f = 2 * 2 * 4, 2 * 1 * 16
    # Layer 0's tokens choose {0, 1, 2, 5}, layer 1's {3}, layer 2's {4, 7}.
    routing = {"layers.0.experts": [torch.tensor([[0, 1], [1, 2], [0, 5], [5, 0], [1, 2], [2, 0]])],
               "layers.1.experts": [torch.tensor([[3, 3]] * 6)],
               "layers.2.experts": [torch.tensor([[7, 4], [4, 7]] * 3)],
               # the assistant's two rows: clusters {0, 3, 5} in step 1, {1, 2} in step 2
               roofline_bytes.CLUSTERS: [torch.tensor([[0, 3], [3, 5]]), torch.tensor([[1, 2], [2, 1]])]}
    for k in (0, 2):
        B, T = k + 1, b * (k + 1)
        got = roofline.step_bytes(model, model.cfg, roofline.Step(b, k, c), routing, assistant if k else None)
        want = {"weights": target * f, "experts": (4 + 1 + 2) * expert * f, "embedding": T * 16 * f,
                "lm_head": 64 * 16 * f, "kv read": b * (2 * min(c + B, 3 + B) * kv_s + (c + B) * kv_f) * f,
                "kv written": T * (2 * kv_s + kv_f) * f}
        if k:
            # The centroid head: centroids [8, 8] with the weights; each chosen cluster's 8
            # embedding rows of 8 and its 8 int64 token_ordering entries.
            want |= {"drafter weights": k * (_assistant_weights([4, 16]) + 8 * 8) * f,
                     "drafter embedding": k * b * 16 * f, "drafter lm_head": (3 + 2) * 8 * (8 * f + 8),
                     "drafter kv read": k * b * (min(c + 1, 5) * kv_s + (c + 1) * kv_f) * f}
        assert got == want, k


def test_gemma4_routing_records_experts_and_clusters(g_moe):
    """A steady verify step with the assistant's proposal: each MoE layer routes the 6 real
    bundle tokens once, the centroid head chooses top-2 clusters for the 2 rows once per draft
    step; the patches are gone afterwards."""
    g = roofline.steady_step(g_moe, Namespace(batch=2, context=10))
    verify, propose, _ = roofline.body_calls(g, 2)
    assistant = g_moe.drafter.assistant
    with torch.inference_mode(), roofline.record_routing(g_moe.model, 2, g._last.num_reqs_padded,
                                                         assistant) as routing:
        verify()
        propose()
    assert sorted(routing) == [roofline_bytes.CLUSTERS, "layers.0.experts", "layers.1.experts", "layers.2.experts"]
    assert [r.shape for r in routing["layers.2.experts"]] == [(6, 2)]
    assert [r.shape for r in routing[roofline_bytes.CLUSTERS]] == [(2, 2), (2, 2)]
    assert all(r.max() < 8 and r.min() >= 0 for rs in routing.values() for r in rs)
    assert "route" not in vars(g_moe.model.layers[0].experts)
    assert "forward" not in vars(assistant.masked_embedding.centroids)
    # With 1 real request of 2 rows, its 3 tokens and 1 row of clusters stay.
    with torch.inference_mode(), roofline.record_routing(g_moe.model, 1, 2, assistant) as routing:
        verify()
        propose()
    assert [r.shape for r in routing["layers.0.experts"]] == [(3, 2)]
    assert [r.shape for r in routing[roofline_bytes.CLUSTERS]] == [(1, 2), (1, 2)]
    # The recorded context is what the byte model is given: the bundle after c cached tokens.
    assert max(g.buf.seq_lens[:2].tolist()) - g.bundle >= 10


def test_gemma4_breakdown_labels_every_part(g_moe):
    g = roofline.steady_step(g_moe, Namespace(batch=2, context=10))
    parts = roofline.breakdown(g_moe, g, 2, reps=1)
    for part in ("attention", "MLP", "MoE", "norms", "lm_head", "drafter attention", "drafter MLP", "drafter norms",
                 "drafter lm_head", "drafter (other)", "sampling/rejection"):
        assert parts.get(part, 0) > 0, part
    assert set(parts) <= set(roofline.PARTS) | {roofline.OTHER}


def test_gemma4_real_configs_keep_the_pattern_and_fit_their_assistant():
    from mtpkit.models.gemma4.assistant_config import Gemma4AssistantConfig, compatibility_problems
    from mtpkit.models.gemma4.config import Gemma4Config
    for model, kv in (("gemma4-31b", (16, 4)), ("gemma4-26b-a4b", (8, 2))):
        raw = roofline_configs.gemma4_config(model, 12)
        t = Gemma4Config.from_dict(raw)
        assert t.layer_types == ((S,) * 5 + (F,)) * 2
        assert t.head_dims == ((256,) * 5 + (512,)) * 2 and t.kv_heads == ((kv[0],) * 5 + (kv[1],)) * 2
        assert t.attention_k_eq_v and t.tie_word_embeddings and t.enable_moe_block == (model == "gemma4-26b-a4b")
        a = Gemma4AssistantConfig.from_dict(roofline_configs.assistant_config(raw))
        assert compatibility_problems(a, t) == [] and a.use_ordered_embeddings
