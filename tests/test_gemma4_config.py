"""Gemma 4 config.json reading: per-layer geometry as transformers 5.24 derives it (both the
saved `per_layer_config` and the hub-style `global_head_dim` / `num_global_key_value_heads`),
the cache groups that follow from it, and every unsupported value refused by name before any
weight is read (the directories below hold a config.json and no weights at all)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_oracle as G  # noqa: E402

from mtpkit import LLM  # noqa: E402
from mtpkit.errors import ConfigError  # noqa: E402
from mtpkit.models.gemma4.model import Gemma4ForCausalLM  # noqa: E402
from mtpkit.models.gemma4.config import Gemma4Config  # noqa: E402

RAW = {**G.CONFIGS["dense"], "model_type": "gemma4_text"}


def _hf_geometry(raw):
    from transformers.models.gemma4 import Gemma4TextConfig
    c = Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    return (tuple(c.per_layer_config[i].head_dim for i in range(c.num_hidden_layers)),
            tuple(c.per_layer_config[i].num_key_value_heads for i in range(c.num_hidden_layers)))


@pytest.mark.parametrize("k_eq_v", [True, False])
@pytest.mark.parametrize("style", ["hub", "saved"])
def test_per_layer_geometry_as_transformers_derives_it(k_eq_v, style):
    pytest.importorskip("transformers")
    raw = {**RAW, "attention_k_eq_v": k_eq_v}
    if style == "saved":   # what save_pretrained writes: per_layer_config, no global_* fields
        from transformers.models.gemma4 import Gemma4TextConfig
        raw = {**Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"}).to_dict(),
               "model_type": "gemma4_text"}
        assert "per_layer_config" in raw and "global_head_dim" not in raw
    cfg = Gemma4Config.from_dict(raw)
    assert (cfg.head_dims, cfg.kv_heads) == _hf_geometry(raw)
    # Full layers differ from sliding ones (else the test would not tell them apart).
    assert cfg.head_dims[2] == 32 and cfg.head_dims[0] == 16
    assert cfg.kv_heads[2] == (1 if k_eq_v else 2)


def test_cache_groups_follow_the_geometry_and_shared_layers_own_none():
    dense = Gemma4ForCausalLM.cache_spec(Gemma4Config.from_dict(RAW), num_spec=0).kv
    assert {(g.num_layers, g.kv_heads, g.head_dim, g.sliding_window) for g in dense} == {(4, 2, 16, 5), (2, 1, 32, None)}
    e2b = Gemma4Config.from_dict({**G.CONFIGS["e2b"], "model_type": "gemma4_text"})
    groups = Gemma4ForCausalLM.cache_spec(e2b, num_spec=0).kv
    assert sum(g.num_layers for g in groups) == 3          # 5 layers, the last 2 KV-shared
    assert [e2b.kv_source(i) for i in range(5)] == [0, 1, 2, 2, 1]
    tp4 = Gemma4ForCausalLM.cache_spec(Gemma4Config.from_dict(RAW), num_spec=0, tp_size=4).kv
    assert {g.kv_heads for g in tp4} == {1}                 # fewer KV heads than ranks: replicated


def test_multimodal_wrapper_reads_its_text_config():
    text = {k: v for k, v in RAW.items() if k != "eos_token_id"}
    cfg = Gemma4Config.from_dict({"model_type": "gemma4", "eos_token_id": [1, 106], "text_config": text,
                                  "vision_config": {}, "audio_config": {}})
    assert cfg.multimodal and cfg.tie_word_embeddings and cfg.eos_token_ids == (1, 106)   # the wrapper's eos
    assert cfg.head_dims == Gemma4Config.from_dict(RAW).head_dims
    assert Gemma4Config.from_dict({"model_type": "gemma4", "eos_token_id": [1, 106], "text_config": RAW}
                                  ).eos_token_ids == (1,)                               # the decoder's own wins


def test_class_defaults_apply_to_omitted_fields():
    """What transformers assumes for an omitted field: per-layer embeddings on, no softcap,
    window 512, a 5:1 pattern with the last layer full, full layers at head_dim 512."""
    raw = {k: RAW[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                               "num_key_value_heads", "head_dim")}
    cfg = Gemma4Config.from_dict({**raw, "model_type": "gemma4_text", "num_hidden_layers": 7})
    assert cfg.hidden_size_per_layer_input == 256 and cfg.vocab_size_per_layer_input == 262144
    assert cfg.final_logit_softcapping is None and cfg.sliding_window == 512
    assert [t[0] for t in cfg.layer_types] == list("sssssff")
    assert cfg.head_dims == (16,) * 5 + (512, 512)


BAD = [
    ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 3}, "layer_types=\\['chunked_attention'\\]"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters\\['sliding_attention'\\].rope_type='yarn'"),
    ({"per_layer_config": {"2": {"head_dim": 32, "sliding_window": 8}}}, "per_layer_config\\['2'\\] overrides \\['sliding_window'\\]"),
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers=6"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, "top_k_experts"),
    ({"num_global_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m[:24] for _, m in BAD])
def test_unsupported_values_refused_by_name_before_weights(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**RAW, **change}))
    with pytest.raises(ConfigError, match=message):
        LLM(tmp_path, device="cpu")


def test_speculation_without_a_drafter_names_the_assistant(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RAW))
    with pytest.raises(ConfigError, match="pass draft_model= \\(the Gemma 4 assistant checkpoint"):
        LLM(tmp_path, device="cpu", num_spec=2)


def test_tensor_parallel_refusal_names_the_dimensions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**RAW, "num_attention_heads": 6, "num_key_value_heads": 3,
                                                      "num_global_key_value_heads": 3}))
    with pytest.raises(ConfigError, match="num_attention_heads=6 is not divisible by 4.*num_key_value_heads=3"):
        Gemma4ForCausalLM.check_tensor_parallel(Gemma4Config.from_dict(json.loads((tmp_path / "config.json").read_text())), 4)
