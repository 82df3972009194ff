"""Tests of the transformers oracle helper (tests/oracle.py) itself; no mtpkit involved."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

CONFIG_NAMES = sorted(O.TINY_CONFIGS)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with O.single_thread():
        yield


def _st_keys_and_shapes(ckpt_dir) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for fn in sorted(os.listdir(ckpt_dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt_dir, fn), "pt") as f:
                for k in f.keys():
                    assert k not in out, f"{k} stored twice"
                    out[k] = tuple(f.get_slice(k).get_shape())
    return out


# ---------------------------------------------------------------------------------------------
# configs, building, checkpoints
# ---------------------------------------------------------------------------------------------


def test_tiny_configs_cover_the_matrix():
    cfgs = {n: O.tiny_config(n) for n in CONFIG_NAMES}
    gqa = {c.num_attention_heads // c.num_key_value_heads for c in cfgs.values()}
    gdn = {c.linear_num_value_heads // c.linear_num_key_heads for c in cfgs.values()}
    assert {1, 2, 4} <= gqa
    assert {1, 2, 4} <= gdn
    assert {1, 2, 3} <= {c.num_experts_per_tok for c in cfgs.values()}
    assert {True, False} == {c.norm_topk_prob for c in cfgs.values()}
    assert {0.25, 0.5} == {c.rope_parameters["partial_rotary_factor"] for c in cfgs.values()}
    assert {8, 16, 32} <= {c.head_dim for c in cfgs.values()}
    assert {2, 4, 5} <= {c.num_hidden_layers for c in cfgs.values()}
    assert any(c.mlp_only_layers for c in cfgs.values())
    assert any(c.layer_types[0] == "full_attention" for c in cfgs.values())
    assert any(c.layer_types[-1] == "linear_attention" for c in cfgs.values())
    assert any("layer_types" in O.TINY_CONFIGS[n] for n in CONFIG_NAMES)
    assert any("full_attention_interval" in O.TINY_CONFIGS[n] for n in CONFIG_NAMES)
    for c in cfgs.values():
        assert 4 <= c.num_experts <= 8 and c.vocab_size in (128, 256) and 32 <= c.hidden_size <= 64
        assert "full_attention" in c.layer_types and "linear_attention" in c.layer_types
        assert c.tie_word_embeddings is False


def test_build_is_deterministic_and_perturbed():
    a = O.build_hf_model("base", seed=5)
    b = O.build_hf_model("base", seed=5)
    c = O.build_hf_model("base", seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    for name, p in a.named_parameters():
        assert p.dtype == torch.float64
        if name.endswith("norm.weight") and "linear_attn" not in name:
            # zero-centred norms are no longer exactly zero
            assert 0 < p.abs().max() < 0.5, name
    gdn = a.model.layers[0].linear_attn
    assert not torch.equal(gdn.dt_bias, torch.ones_like(gdn.dt_bias))
    assert a.config._experts_implementation == "eager" and not a.training
    # float32 and float64 builds hold identical (float32-representable) weights
    f = O.build_hf_model("base", seed=5, dtype=torch.float32)
    assert all(torch.equal(p.double(), sa[k]) for k, p in f.state_dict().items())


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_build_save_with_mtp_and_reload(name, tmp_path):
    kw = O.TINY_CONFIGS[name]
    model = O.build_hf_model(kw, seed=11)
    assert O.param_count(model) < 1_000_000
    mtp = O.make_mtp_state_dict(kw, seed=11, std=0.05)
    O.save_checkpoint(model, tmp_path, mtp_state=mtp)

    on_disk = _st_keys_and_shapes(tmp_path)
    for k, t in mtp.items():
        assert on_disk[k] == tuple(t.shape), k
    assert sum(k.startswith("mtp.") for k in on_disk) == len(mtp)

    loaded, info = O.load_hf_model(tmp_path, with_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # transformers drops mtp.* silently (_keys_to_ignore_on_load_unexpected = [r"^mtp.*"])
    assert not any(k.startswith("model.") or k.startswith("lm_head") for k in info["unexpected_keys"])
    prompt = O.random_prompt(9, kw["vocab_size"], seed=1)
    want = O.hf_logits(model, prompt)
    got = O.hf_logits(loaded, prompt)
    assert got.dtype == torch.float64 and want.shape == (9, kw["vocab_size"])
    # separately loaded: equal up to rounding, not bitwise (see oracle.SEPARATE_LOAD_ATOL)
    O.assert_same_logits(got, want)


def test_separate_load_tolerance_catches_a_perturbed_weight(tmp_path):
    """The planted fault behind SEPARATE_LOAD_ATOL: one saved weight off by 1e-6 fails it."""
    from safetensors.torch import load_file, save_file

    kw = O.TINY_CONFIGS["base"]
    model = O.build_hf_model(kw, seed=11)
    O.save_checkpoint(model, tmp_path)
    prompt = O.random_prompt(9, kw["vocab_size"], seed=1)
    want = O.hf_logits(model, prompt)
    O.assert_same_logits(O.hf_logits(O.load_hf_model(tmp_path), prompt), want)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    if name not in tensors:  # the name depends on the transformers version: any layer-0 matrix
        name = next(n for n, t in tensors.items() if n.startswith("model.layers.0.") and t.dim() == 2)
    tensors[name][0, 0] += 1e-6
    save_file(tensors, str(f), metadata={"format": "pt"})
    got = O.hf_logits(O.load_hf_model(tmp_path), prompt)
    d = float((got - want).abs().max())
    assert d > 100 * O.SEPARATE_LOAD_ATOL, d
    with pytest.raises(AssertionError):
        O.assert_same_logits(got, want)


def test_mtp_names_match_a_saved_full_attention_layer(tmp_path):
    """mtp.layers.0.* must be exactly what save_pretrained writes for a full-attention MoE layer."""
    kw = O.TINY_CONFIGS["base"]  # layer 3 is full attention with MoE
    model = O.build_hf_model(kw, seed=0)
    O.save_checkpoint(model, tmp_path)
    on_disk = _st_keys_and_shapes(tmp_path)
    full = {k[len("model.layers.3."):]: s for k, s in on_disk.items() if k.startswith("model.layers.3.")}
    shapes = O.mtp_param_shapes(kw)
    layer0 = {k[len("mtp.layers.0."):]: s for k, s in shapes.items() if k.startswith("mtp.layers.0.")}
    assert layer0 == full
    H = kw["hidden_size"]
    assert shapes["mtp.fc.weight"] == (H, 2 * H)
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        assert shapes[n] == (H,)
    assert set(shapes) == {k for k in shapes if k.startswith("mtp.")}
    # dense-MLP configs still get an MoE MTP layer
    dense = O.mtp_param_shapes("full_first_dense1")
    assert "mtp.layers.0.mlp.gate.weight" in dense and "mtp.layers.0.mlp.shared_expert_gate.weight" in dense
    a, b = O.make_mtp_state_dict(kw, 3), O.make_mtp_state_dict(kw, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float32 and float(t.abs().mean()) < 0.1 for t in a.values())


def test_sharded_checkpoint_with_mtp(tmp_path):
    kw = O.TINY_CONFIGS["five_layer"]
    model = O.build_hf_model(kw, seed=2)
    mtp = O.make_mtp_state_dict(kw, seed=2)
    O.save_checkpoint(model, tmp_path, mtp_state=mtp, dtype=torch.float32, shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1
    assert not (tmp_path / "model.safetensors").exists()
    on_disk = _st_keys_and_shapes(tmp_path)
    assert set(index["weight_map"]) == set(on_disk)
    assert len({index["weight_map"][k] for k in mtp}) > 1  # mtp spread over shards
    assert index["metadata"]["total_size"] == sum(
        4 * int(torch.tensor(s).prod()) if s else 4 for s in on_disk.values()
    )
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    # the original float64 model is untouched, and the reload holds the same weights (fp32-representable)
    assert next(model.parameters()).dtype == torch.float64
    loaded = O.load_hf_model(tmp_path)
    p = O.random_prompt(5, kw["vocab_size"], 0)
    O.assert_same_logits(O.hf_logits(loaded, p), O.hf_logits(model, p))  # separately loaded


# ---------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------


def _uncached_argmax_chain(model, prompt, n):
    seq, toks = list(prompt), []
    for _ in range(n):
        t = int(O.hf_logits(model, seq)[-1].argmax())
        toks.append(t)
        seq.append(t)
    return toks


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_hf_greedy_matches_uncached_argmax(name):
    kw = O.TINY_CONFIGS[name]
    model = O.build_hf_model(kw, seed=21)
    plen = 70 if name == "base" else 6  # base: prompt longer than the GDN chunk (64)
    prompt = O.random_prompt(plen, kw["vocab_size"], seed=21)
    n = 6
    ref, step_logits = O.hf_greedy_with_logits(model, prompt, n)
    assert len(ref) == n and len(step_logits) == n
    if name == "base":
        assert O.hf_greedy(model, prompt, n) == ref
    assert all(lg.shape == (kw["vocab_size"],) for lg in step_logits)
    assert all(int(lg.argmax()) == t for lg, t in zip(step_logits, ref))
    ours = _uncached_argmax_chain(model, prompt, n)
    O.assert_greedy_matches(ours, ref, step_logits, tol=1e-3, context=name)
    # the hand-written cached loop agrees with generate and keeps float64 logits
    loop, loop_logits = O.hf_greedy_with_logits(model, prompt, n, method="loop")
    assert loop_logits[0].dtype == torch.float64 and step_logits[0].dtype == torch.float32
    O.assert_greedy_matches(loop, ref, step_logits, tol=1e-3)
    # cached step logits agree with the uncached forward at float32-rounding level
    full = O.hf_logits(model, prompt + loop)
    for j in range(n):
        assert torch.allclose(loop_logits[j], full[len(prompt) - 1 + j], atol=1e-5, rtol=0)


def test_greedy_exactly_n_even_with_eos_configured():
    model = O.build_hf_model("alt_top1_norm", seed=4)
    prompt = O.random_prompt(4, 256, seed=4)
    ref = O.hf_greedy(model, prompt, 6)
    # make the first generated token "eos": generation must still run for exactly n tokens
    model.generation_config.eos_token_id = ref[0]
    model.config.eos_token_id = ref[0]
    assert O.hf_greedy(model, prompt, 6) == ref
    assert O.hf_greedy(model, prompt, 0) == []
    assert len(O.hf_greedy(model, prompt, 1)) == 1


def test_check_greedy_against_hf():
    model = O.build_hf_model("mha_hd8_top1", seed=8)
    prompt = O.random_prompt(5, 128, seed=8)
    ref, logits = O.hf_greedy_with_logits(model, prompt, 6)
    rep = O.check_greedy_against_hf(model, prompt, ref)
    assert rep.ok and rep.identical and rep.compared == 6
    bad = list(ref)
    bad[3] = int(logits[3].argmin())
    rep = O.check_greedy_against_hf(model, prompt, bad)
    assert not rep.ok and rep.diverge_at == 3 and rep.gap > 1e-3
    assert "real divergence" in str(rep)


def test_exact_fp64_mode():
    import transformers.models.qwen3_next.modeling_qwen3_next as M

    before = M.Qwen3NextRMSNorm.forward
    model = O.build_hf_model("gqa4_hd32_top3", seed=9)
    prompt = O.random_prompt(66, model.config.vocab_size, seed=9)
    stock = O.hf_logits(model, prompt)
    with O.exact_fp64():
        assert M.Qwen3NextRMSNorm.forward is not before
        exact = O.hf_logits(model, prompt)
        toks, step = O.hf_greedy_with_logits(model, prompt, 5, method="loop")
        full = O.hf_logits(model, prompt + toks)
    assert M.Qwen3NextRMSNorm.forward is before
    assert torch.equal(O.hf_logits(model, prompt), stock)
    d = float((stock - exact).abs().max())
    assert 0 < d < 1e-4  # stock HF has float32 internals
    for j in range(5):
        assert torch.allclose(step[j], full[len(prompt) - 1 + j], atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------
# tie-aware comparison logic
# ---------------------------------------------------------------------------------------------


def _logits(vocab, values: dict[int, float]):
    t = torch.zeros(vocab, dtype=torch.float64)
    for k, v in values.items():
        t[k] = v
    return t


def test_compare_identical():
    logits = [_logits(8, {1: 1.0}), _logits(8, {2: 1.0}), _logits(8, {3: 1.0})]
    rep = O.compare_greedy_tie_aware([1, 2, 3], [1, 2, 3], logits)
    assert rep.ok and rep.identical and rep.tie_at is None and rep.gap is None and bool(rep)
    assert "identical" in str(rep)
    assert O.compare_greedy_tie_aware([], [], []).identical


def test_compare_near_tie_accepted_then_stops_comparing():
    logits = [_logits(8, {1: 1.0}), _logits(8, {2: 1.0, 5: 1.0 - 5e-4}), _logits(8, {3: 1.0})]
    rep = O.compare_greedy_tie_aware([1, 5, 7, 7], [1, 2, 3, 4], logits, tol=1e-3)
    assert rep.ok and not rep.identical and rep.tie_at == 1
    assert rep.gap == pytest.approx(5e-4)
    assert "near-tie" in str(rep)
    O.assert_greedy_matches([1, 5, 7, 7], [1, 2, 3, 4], logits, tol=1e-3)
    # the same divergence with a tighter tolerance is a failure
    rep = O.compare_greedy_tie_aware([1, 5, 7], [1, 2, 3], logits, tol=1e-4)
    assert not rep.ok and rep.tie_at is None and rep.diverge_at == 1
    # the gap must be strictly below tol
    rep = O.compare_greedy_tie_aware([1, 5], [1, 2], [logits[0], _logits(8, {2: 1.0, 5: 0.75})], tol=0.25)
    assert not rep.ok


def test_compare_real_mismatch_fails():
    logits = [_logits(8, {1: 1.0, 6: 0.2}), _logits(8, {2: 1.0})]
    rep = O.compare_greedy_tie_aware([6, 2], [1, 2], logits, tol=1e-3)
    assert not rep.ok and not rep.identical and rep.diverge_at == 0 and rep.gap == pytest.approx(0.8)
    with pytest.raises(AssertionError, match="real divergence at step 0"):
        O.assert_greedy_matches([6, 2], [1, 2], logits, context="ctx")
    with pytest.raises(AssertionError, match=r"\[ctx\]"):
        O.assert_greedy_matches([6, 2], [1, 2], logits, context="ctx")


def test_compare_length_mismatch_and_bad_token_fail():
    logits = [_logits(8, {1: 1.0}), _logits(8, {2: 1.0}), _logits(8, {3: 1.0})]
    rep = O.compare_greedy_tie_aware([1, 2], [1, 2, 3], logits)
    assert not rep.ok and "length mismatch" in str(rep)
    rep = O.compare_greedy_tie_aware([1, 2, 3, 4], [1, 2, 3], logits)
    assert not rep.ok
    rep = O.compare_greedy_tie_aware([1, 99], [1, 2], logits)
    assert not rep.ok and "outside the vocab" in str(rep)


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------


def test_random_prompts():
    a = O.random_prompts(6, 128, seed=3, min_len=1, max_len=70)
    assert a == O.random_prompts(6, 128, seed=3, min_len=1, max_len=70)
    assert a != O.random_prompts(6, 128, seed=4, min_len=1, max_len=70)
    lens = [len(p) for p in a]
    assert min(lens) == 1 and max(lens) == 70 and len(set(lens)) > 2
    assert all(0 <= t < 128 for p in a for t in p)
    b = O.random_prompts(4, 256, seed=0, lengths=O.PROMPT_LENGTHS)
    assert [len(p) for p in b] == list(O.PROMPT_LENGTHS[:4])
    assert O.random_prompt(12, 256, 1) == O.random_prompt(12, 256, 1)
    assert len(O.random_prompt(65, 256, 1)) == 65
