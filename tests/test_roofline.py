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
