"""Gemma 4 at real shapes (tests/gemma4_shapes.py): every variant builds on the meta device
at its full layer count with consistent checkpoint shapes and the KV geometry the reference
gives (31B in bf16: ~800 KB per token for the sliding layers, ~80 KB for the full ones), and
runs through the engine with load_format="dummy" at E2B's real widths (4 layers, two of them
KV-shared, and a 2048-token vocabulary, for CPU memory and time; the larger variants' layers
hold 0.4-0.8 G parameters each, too many for a CPU test: benchmarks/gpu_check.py runs them)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_shapes as S  # noqa: E402

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.kernels.ops import TORCH  # noqa: E402
from mtpkit.models.gemma4.model import Gemma4ForCausalLM  # noqa: E402
from mtpkit.models.gemma4.config import Gemma4Config  # noqa: E402
from mtpkit.checkpoint.loader import weight_specs  # noqa: E402


@pytest.mark.parametrize("name", sorted(S.REAL))
def test_real_shapes_build_on_meta(name):
    cfg = Gemma4Config.from_dict(S.REAL[name])
    with torch.device("meta"):
        model = Gemma4ForCausalLM(cfg, TORCH)
    specs = weight_specs(model)
    for spec in specs:   # each parameter's checkpoint sources agree with its own size
        assert spec.param.numel() == sum(torch.Size(s).numel() for s in spec.sources.values()), spec.sources
    names = {n for spec in specs for n in spec.sources}
    shared = range(cfg.first_shared_layer, cfg.num_hidden_layers)
    assert not any(f"model.layers.{i}.self_attn.k_proj.weight" in names for i in shared)
    groups = Gemma4ForCausalLM.cache_spec(cfg, num_spec=0).kv
    assert sum(g.num_layers for g in groups) == cfg.first_shared_layer
    for size in (2, 4, 8):
        Gemma4ForCausalLM.check_tensor_parallel(cfg, size)   # the real models split on up to 8 ranks


def test_31b_kv_bytes_per_token_match_the_reference():
    groups = Gemma4ForCausalLM.cache_spec(Gemma4Config.from_dict(S.REAL["31B"]), num_spec=0).kv
    per_token = {g.sliding_window: g.bytes_per_block(1, torch.bfloat16) for g in groups}
    assert per_token == {1024: 50 * 2 * 16 * 256 * 2, None: 10 * 2 * 4 * 512 * 2}   # 800 KiB, 80 KiB


def test_dummy_weights_run_at_real_widths(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(S.scaled("E2B", layers=4, vocab=2048)))
    llm = LLM(tmp_path, load_format="dummy", dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2,
              kv_cache_memory=64 << 20)
    out = llm.generate([[5, 6, 7, 8, 9], [3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in out)
    logits = llm.score(list(range(1, 12)))
    assert torch.isfinite(logits).all() and logits.std() > 0.1    # norms at 1: the layers do not vanish
