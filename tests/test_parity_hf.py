"""Parity of mtpkit with transformers 5.24 ``Qwen3NextForCausalLM`` on tiny random models.

Issue requirement: models built from several tiny random configs (all of oracle.TINY_CONFIGS:
GQA ratios 1/2/4, GDN HV/HK ratios 1/2/4, different layer patterns, top-1/2/3 routing), weights
perturbed (std 0.05) and lm_head scaled x4 so the distributions are not near-uniform, saved with
``save_pretrained`` (+ random ``mtp.*`` tensors) and loaded by mtpkit:

- ``score`` logits within 1e-4 of the logit scale at every position (float64 engine vs HF
  float64). HF float64 runs its norms, RoPE, router and GDN core in float32 (oracle.HF_FP64_NOTES)
  so the reference itself carries ~1e-7 relative rounding; measured mtpkit-vs-HF: <= 2.6e-6 of the
  per-position scale.
- chunked prefill (a 7-token budget) gives the one-shot logits to 1e-10 (float64).
- float32 engine within FP32_REL_TOL of the scale; bfloat16 runs and agrees on the argmax at most
  positions (rates printed).
- greedy: a batch of prompts of different lengths (1 .. 97, crossing the GDN chunk size 64), run
  together and one by one, 32 new tokens with ignore_eos, compared tie-aware with HF greedy (eos
  disabled on the HF side, NOT min_new_tokens), and batch == one-by-one exactly.
- checkpoint variants: sharded, bf16 / fp32 on disk, full_attention_interval instead of
  layer_types, mtp.* present with num_spec=0.

The seed is fixed (SEED = 0) and was not picked to make anything pass.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

from mtpkit import LLM, SamplingParams  # noqa: E402

CONFIG_NAMES = sorted(O.TINY_CONFIGS)
SEED = 0

FP64_REL_TOL = 1e-4   # issue: within 1e-4 of the logit scale (measured <= 2.6e-6)
# float32 engine vs HF float64: fp32 eps is 1.2e-7; a few layers of norms, GDN recurrence over
# 150 tokens and softmaxes accumulate ~30 eps; measured <= 4.3e-6 of the per-position scale on
# these configs. 5e-5 keeps a >10x margin while still catching any real error (a wrong weight,
# RoPE or routing gives O(1e-2..1) of the scale).
FP32_REL_TOL = 5e-5
CHUNKED_ATOL = 1e-10  # float64 chunked prefill vs one-shot
# bfloat16: HF's own bfloat16 model agrees with HF float64 on 0.89..0.99 of the argmaxes on these
# configs (mtpkit bf16: 0.84..0.98 on the prompt below, 0.89 averaged over 6 prompts for
# five_layer); median per-position error ~1-4% of the scale.
BF16_MIN_ARGMAX_AGREEMENT = 0.75
BF16_MAX_MEDIAN_REL = 0.1

GREEDY_LENGTHS = (1, 6, 23, 64, 97)
NEW_TOKENS = 32
TIE_TOL = 1e-3
MAX_TIE_RATE = 1 / 200  # accepted near-ties per compared token, over the whole module

_TIES: list[tuple[str, int, int, int]] = []     # (config, prompt length, ties, compared tokens)
_MEASURED: dict[str, dict[str, float]] = {}      # config -> measured quantities (printed at the end)
_HF_CHECKED: dict[tuple, O.TieReport] = {}        # (config, prompt, ours) -> report (memo)


def _vocab(name: str) -> int:
    return O.TINY_CONFIGS[name]["vocab_size"]


def _llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float64")
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("enforce_eager", True)
    return LLM(path, **kw)


def _score_fp64(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(public score() output, the model-dtype logits it was made from).

    ``LLM.score`` returns float32 logits; to check float64 numerics we record what
    ``model.compute_logits`` returned before the cast (score() calls it once per prefill chunk).
    """
    captured: list[torch.Tensor] = []
    orig = llm.model.compute_logits

    def recording(hidden):
        out = orig(hidden)
        captured.append(out.detach().clone())
        return out

    llm.model.compute_logits = recording
    try:
        public = llm.score(ids)
    finally:
        del llm.model.compute_logits  # back to the class method
    return public, torch.cat(captured)


def _rel_err_per_position(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """max_v |ours - ref| / max_v |ref|, per position."""
    ref = ref.double()
    return (ours.double() - ref).abs().amax(-1) / ref.abs().amax(-1)


def _score_prompts(name: str) -> list[list[int]]:
    V = _vocab(name)
    # 150 crosses the GDN chunk size (64) twice; 1 is the degenerate single-token case.
    return [O.random_prompt(150, V, seed=SEED + 11), O.random_prompt(1, V, seed=SEED + 12)]


@pytest.fixture(scope="module")
def hf_ref_logits(hf_checkpoint):
    """HF float64 logits of the score prompts, per config (computed once)."""
    cache: dict[str, list[torch.Tensor]] = {}

    def get(name: str) -> list[torch.Tensor]:
        if name not in cache:
            model, _ = hf_checkpoint(name, SEED)
            cache[name] = [O.hf_logits(model, p) for p in _score_prompts(name)]
        return cache[name]

    return get


# ---------------------------------------------------------------------------------------------
# score
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_score_fp64_matches_hf_every_position(name, hf_checkpoint, hf_ref_logits):
    model, path = hf_checkpoint(name, SEED)
    llm = _llm(path)
    worst = 0.0
    for ids, ref in zip(_score_prompts(name), hf_ref_logits(name)):
        assert float(ref.abs().max()) > 2.0, "distribution too flat: the test would be weak"
        public, ours = _score_fp64(llm, ids)
        assert ours.dtype == torch.float64
        assert public.shape == ours.shape == ref.shape == (len(ids), _vocab(name))
        assert torch.isfinite(public).all()
        rel = _rel_err_per_position(ours, ref)
        bad = (rel > FP64_REL_TOL).nonzero().flatten().tolist()
        assert not bad, (f"{name}: positions {bad[:10]} exceed {FP64_REL_TOL:g} of the logit scale "
                         f"(worst {float(rel.max()):.3g} at {int(rel.argmax())})")
        # the public float32 output is the same within float32 rounding
        rel_pub = _rel_err_per_position(public, ref)
        assert float(rel_pub.max()) <= FP64_REL_TOL
        worst = max(worst, float(rel.max()))
    _MEASURED.setdefault(name, {})["fp64_rel"] = worst


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_score_chunked_prefill_equals_one_shot(name, hf_checkpoint):
    _, path = hf_checkpoint(name, SEED)
    ids = _score_prompts(name)[0]
    pub1, one_shot = _score_fp64(_llm(path), ids)
    # 7-token chunks (not aligned with the GDN chunk 64 nor the KV block 8), twice to check that
    # score leaves no state behind.
    chunked_llm = _llm(path, max_num_batched_tokens=7, block_size=8)
    for _ in range(2):
        pub2, chunked = _score_fp64(chunked_llm, ids)
        assert chunked.shape == one_shot.shape
        diff = float((chunked - one_shot).abs().max())
        assert diff <= CHUNKED_ATOL, f"{name}: chunked vs one-shot float64 logits differ by {diff:.3g}"
        scale = float(one_shot.abs().max())
        assert float((pub2 - pub1).abs().max()) <= 2 * torch.finfo(torch.float32).eps * scale
    _MEASURED.setdefault(name, {})["chunked_diff"] = diff


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_score_fp32_and_bf16(name, hf_checkpoint, hf_ref_logits):
    _, path = hf_checkpoint(name, SEED)
    ids = _score_prompts(name)[0]
    ref = hf_ref_logits(name)[0]

    out32 = _llm(path, dtype="float32").score(ids)
    assert out32.dtype == torch.float32 and torch.isfinite(out32).all()
    rel32 = _rel_err_per_position(out32, ref)
    assert float(rel32.max()) <= FP32_REL_TOL, (
        f"{name}: float32 engine off by {float(rel32.max()):.3g} of the scale at position "
        f"{int(rel32.argmax())} (tolerance {FP32_REL_TOL:g})")

    llm16 = _llm(path, dtype="bfloat16")
    out16 = llm16.score(ids)
    assert torch.isfinite(out16).all()
    agree = float((out16.argmax(-1) == ref.argmax(-1)).double().mean())
    med = float(_rel_err_per_position(out16, ref).median())
    assert agree >= BF16_MIN_ARGMAX_AGREEMENT, f"{name}: bf16 argmax agreement {agree:.3f}"
    assert med <= BF16_MAX_MEDIAN_REL, f"{name}: bf16 median error {med:.3g} of the scale"
    # bf16 generation runs and stays in the vocabulary
    out = llm16.generate([ids[:5], ids[:70]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [8, 8]
    assert all(0 <= t < _vocab(name) for o in out for t in o.token_ids)
    m = _MEASURED.setdefault(name, {})
    m.update(fp32_rel=float(rel32.max()), bf16_argmax=agree, bf16_median_rel=med)


# ---------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------


def _check_hf(name: str, model, prompt: list[int], ours: list[int]) -> O.TieReport:
    key = (name, tuple(prompt), tuple(ours))
    if key not in _HF_CHECKED:
        rep = O.check_greedy_against_hf(model, prompt, ours, tol=TIE_TOL)
        _HF_CHECKED[key] = rep
        _TIES.append((name, len(prompt), len(rep.ties), rep.compared))
    return _HF_CHECKED[key]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_greedy_matches_hf_batch_and_one_by_one(name, hf_checkpoint):
    model, path = hf_checkpoint(name, SEED)
    V = _vocab(name)
    prompts = [O.random_prompt(L, V, seed=SEED + 100 + i) for i, L in enumerate(GREEDY_LENGTHS)]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    # together (with the capture-size padding of the non-eager dispatch), and with 13-token
    # prefill chunks / 8-token blocks
    batch = _llm(path, enforce_eager=False).generate(prompts, params)
    batch_chunked = _llm(path, max_num_batched_tokens=13, block_size=8).generate(prompts, params)
    # more prompts than max_num_seqs: some wait while others decode
    batch_queued = _llm(path, max_num_seqs=2).generate(prompts, params)
    solo_llm = _llm(path)
    solo = [solo_llm.generate([p], params)[0] for p in prompts]

    for outs, what in ((batch, "batch"), (batch_chunked, "batch, chunked prefill"),
                       (batch_queued, "batch, max_num_seqs=2"), (solo, "one by one")):
        assert len(outs) == len(prompts)
        for o, p in zip(outs, prompts):
            assert o.error is None and o.finish_reason == "length", (what, o.finish_reason, o.error)
            assert o.prompt_token_ids == p
            assert len(o.token_ids) == NEW_TOKENS, (what, len(p), len(o.token_ids))
    # same engine numerics in float64: exactly the same tokens
    for i, p in enumerate(prompts):
        assert batch[i].token_ids == solo[i].token_ids, f"{name}: prompt len {len(p)}: batch != one by one"
        assert batch_chunked[i].token_ids == solo[i].token_ids, f"{name}: prompt len {len(p)}: chunked != solo"
        assert batch_queued[i].token_ids == solo[i].token_ids, f"{name}: prompt len {len(p)}: queued != solo"

    failures = []
    for outs, what in ((batch, "batch"), (solo, "one by one")):
        for o, p in zip(outs, prompts):
            rep = _check_hf(name, model, p, o.token_ids)
            if not rep.ok:
                failures.append(f"[{name} {what} prompt len {len(p)}] {rep}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# checkpoint variants
# ---------------------------------------------------------------------------------------------


def test_sharded_checkpoint_gives_identical_logits(hf_checkpoint, tmp_path):
    name = "five_layer"
    model, path = hf_checkpoint(name, SEED)
    sharded = O.save_checkpoint(model, tmp_path / "sharded", mtp_state=O.make_mtp_state_dict(name, SEED),
                                shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert not (sharded / "model.safetensors").exists() and len(files) >= 3
    assert len({f for k, f in index["weight_map"].items() if k.startswith("mtp.")}) >= 2
    ids = _score_prompts(name)[0]
    _, ref = _score_fp64(_llm(path), ids)
    _, got = _score_fp64(_llm(sharded), ids)
    O.assert_same_logits(got, ref)  # separately loaded: equal up to rounding (oracle.SEPARATE_LOAD_ATOL)
    # and it also loads with the MTP head (the mtp.* tensors are spread over several shards)
    spec = _llm(sharded, num_spec=2)
    assert spec.model.mtp is not None


@pytest.mark.parametrize("disk_dtype", [torch.float32, torch.bfloat16])
def test_fp32_and_bf16_checkpoints_load_into_float64(hf_checkpoint, tmp_path, disk_dtype):
    from safetensors import safe_open

    name = "full_first_dense1"
    model, path = hf_checkpoint(name, SEED)
    ck = O.save_checkpoint(model, tmp_path / "ck", mtp_state=O.make_mtp_state_dict(name, SEED),
                           dtype=disk_dtype)
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == disk_dtype
        disk_lm_head = f.get_tensor("lm_head.weight")
    llm = _llm(ck, dtype="float64")
    assert all(p.dtype == torch.float64 for p in llm.model.parameters())
    assert torch.equal(llm.model.lm_head, disk_lm_head.double())
    ids = _score_prompts(name)[0]
    _, got = _score_fp64(llm, ids)
    if disk_dtype == torch.float32:
        # the oracle's weights are exactly representable in float32: nothing is lost on disk
        _, ref = _score_fp64(_llm(path), ids)
        O.assert_same_logits(got, ref)  # separately loaded: equal up to rounding
    else:
        # compare with HF loading the same bf16 checkpoint into float64
        hf = O.load_hf_model(ck, dtype=torch.float64)
        ref = O.hf_logits(hf, ids)
        rel = _rel_err_per_position(got, ref)
        assert float(rel.max()) <= FP64_REL_TOL, float(rel.max())
        # dtype="auto" is float32 on CPU (the checkpoint's dtype on CUDA)
        assert _llm(ck, dtype="auto").dtype == torch.float32


@pytest.mark.parametrize("name,interval", [("alt_top1_norm", 2), ("five_layer", 4)])
def test_full_attention_interval_instead_of_layer_types(hf_checkpoint, tmp_path, name, interval):
    model, path = hf_checkpoint(name, SEED)
    ck = tmp_path / "ck"
    shutil.copytree(path, ck)
    cfg = json.loads((ck / "config.json").read_text())
    layer_types = cfg.pop("layer_types")
    assert layer_types == list(model.config.layer_types)
    cfg["full_attention_interval"] = interval
    (ck / "config.json").write_text(json.dumps(cfg, indent=2))
    llm = _llm(ck)
    assert list(llm.model_config.layer_types) == layer_types
    ids = _score_prompts(name)[0]
    _, ref = _score_fp64(_llm(path), ids)
    _, got = _score_fp64(llm, ids)
    O.assert_same_logits(got, ref)  # separately loaded: equal up to rounding


def test_mtp_weights_ignored_with_num_spec_0(hf_checkpoint):
    from mtpkit.speculative.mtp import has_mtp_weights

    name = "base"
    _, with_mtp = hf_checkpoint(name, SEED, with_mtp=True)
    _, without = hf_checkpoint(name, SEED, with_mtp=False)
    assert has_mtp_weights(with_mtp) and not has_mtp_weights(without)
    a = _llm(with_mtp, num_spec=0)
    b = _llm(without, num_spec=0)
    assert a.model.mtp is None
    assert not any(n.startswith("mtp") for n, _ in a.model.named_parameters())
    ids = _score_prompts(name)[0]
    O.assert_same_logits(_score_fp64(a, ids)[1], _score_fp64(b, ids)[1])  # separately loaded
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert a.generate([ids[:9]], params)[0].token_ids == b.generate([ids[:9]], params)[0].token_ids


# ---------------------------------------------------------------------------------------------
# summary (last in the module)
# ---------------------------------------------------------------------------------------------


def test_zz_summary_ties_are_rare():
    """Print the measured tolerances and the accepted near-ties; ties must be rare."""
    lines = ["", "mtpkit vs HF parity summary (relative to the per-position logit scale):"]
    for name in sorted(_MEASURED):
        m = _MEASURED[name]
        lines.append("  " + name.ljust(18) + " ".join(f"{k}={v:.3g}" for k, v in sorted(m.items())))
    n_ties = sum(t for _, _, t, _ in _TIES)
    compared = sum(c for _, _, _, c in _TIES)
    lines.append(f"  greedy: {len(_TIES)} HF comparisons, {compared} tokens compared, {n_ties} accepted "
                 f"near-ties (tol {TIE_TOL:g})")
    for name, plen, t, c in _TIES:
        if t:
            lines.append(f"    tie(s): {name} prompt len {plen}: {t} in {c} tokens")
    if _MEASURED.get(CONFIG_NAMES[0], {}).get("bf16_argmax") is not None:
        rates = [m["bf16_argmax"] for m in _MEASURED.values() if "bf16_argmax" in m]
        lines.append(f"  bf16 argmax agreement: min {min(rates):.3f} mean {statistics.mean(rates):.3f}")
    print("\n".join(lines))
    if compared:
        assert n_ties <= MAX_TIE_RATE * compared, f"{n_ties} near-ties in {compared} tokens: too many"
