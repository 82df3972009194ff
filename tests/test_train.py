"""training.train's second stage (the MTP head alone, from a checkpoint): losses and what moves."""

import torch

from mtpkit.checkpoint.hub import resolve_model
from training.train import (SIZES, TrainArgs, build_model, forward_losses, init_from_checkpoint, set_trainable,
                          train)


def _model():
    m = build_model(SIZES["l4-e64"], seed=0)
    init_from_checkpoint(m, resolve_model("tiny-qwen3-next"), SIZES["l4-e64"])
    return m


def _batch(B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T + 2), generator=g)


def test_frozen_target_gets_no_gradient_and_distill_zero_is_data_loss():
    m, batch = _model(), _batch()
    set_trainable(m, "mtp")
    out = forward_losses(m, batch, mtp_depth=3, frozen_target=True)
    assert len(out["mtp"]) == 3 and not out["ntp"].requires_grad
    sum(out["mtp"]).backward()
    for name, p in m.named_parameters():
        assert (p.grad is not None) == name.startswith("mtp."), name
    with torch.no_grad():
        plain = forward_losses(m, batch, mtp_depth=3)
        zero = forward_losses(m, batch, mtp_depth=3, frozen_target=True, distill=0.0)
        full = forward_losses(m, batch, mtp_depth=3, frozen_target=True, distill=1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain["mtp"], zero["mtp"]))
    # distill 1: cross-entropy against the target's own next distribution, which is at least
    # that distribution's entropy and differs from the data loss
    assert all(torch.isfinite(x) and not torch.equal(x, y) for x, y in zip(full["mtp"], plain["mtp"]))


def test_distill_loss_is_cross_entropy_to_the_targets_next_distribution():
    m, batch = _model(), _batch(B=1, T=12)
    B, T = batch.shape[0], batch.shape[1] - 2
    with torch.no_grad():
        out = forward_losses(m, batch, mtp_depth=1, frozen_target=True, distill=1.0)
        # reference, position by position: the target's distribution at t+1 against the MTP's at t
        full = forward_losses(m, batch, mtp_depth=1)
        from training.train import fresh_cache, prefill_step
        ids, pos, meta = prefill_step(B, T, batch[:, :T])
        cache = fresh_cache(m, B, T)
        hid = m(ids, pos, meta, cache)
        p = torch.softmax(m.compute_logits(hid), -1)
        q = torch.log_softmax(m.compute_logits(m.mtp_forward(batch[:, 1:T + 1].reshape(-1), pos, hid, meta, cache)), -1)
        ref = -sum((p[t + 1] * q[t]).sum() for t in range(T - 1)) / (T - 1)
    assert torch.allclose(out["mtp"][0], ref, rtol=1e-5)
    assert not torch.allclose(full["mtp"][0], ref)


def test_mtp_stage_trains_only_the_mtp_head(tmp_path):
    base = _model()
    a = TrainArgs(steps=2, batch=2, seq_len=32, warmup=1, mtp_weights=(1.0, 0.8, 0.6), eval_every=10**6,
                  save_every=10**6, export_every=10**6, work_dir=str(tmp_path / "work"),
                  out_dir=str(tmp_path / "out"), init_from=str(resolve_model("tiny-qwen3-next")),
                  train_part="mtp", distill=0.5, seed=1)
    threads = torch.get_num_threads()
    try:
        trained = train(a, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)  # train() sets its own thread count
    before, after = dict(base.named_parameters()), dict(trained.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(n.startswith("mtp.") for n in moved)
    assert (tmp_path / "out" / "model.safetensors").exists()
    header, *rows = (tmp_path / "work" / "loss.tsv").read_text().splitlines()
    assert header.split("\t")[4:8] == ["ntp", "mtp1", "mtp2", "mtp3"] and len(rows) == 2
    assert all(len(r.split("\t")) == len(header.split("\t")) for r in rows)


def test_inference_keyed_pass_equals_the_engine_pass_when_it_is_the_first():
    """With no earlier pass the inference-keyed MTP pass is the plain causal pass."""
    from training.train import _mtp_pass_inference_keys, fresh_cache, inference_key_mask, prefill_step

    m, batch = _model(), _batch(B=2, T=10)
    B, T = 2, 10
    with torch.no_grad():
        ids, pos, meta = prefill_step(B, T, batch[:, :T])
        cache = fresh_cache(m, B, T)
        hid = m(ids, pos, meta, cache)
        nxt = batch[:, 1:T + 1].reshape(-1)
        want = m.mtp_forward(nxt, pos, hid, meta, cache, step=0)
        got = _mtp_pass_inference_keys(m, nxt, pos, hid, meta, fresh_cache(m, B, T), 0, [], B, T)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # pass 3 (j=2) at t=5 (drafting from p=3) sees pass 1 at 0..3, pass 2 at 4, itself at 5
    mask = inference_key_mask(8, 2).view(8, 3, 8)
    assert mask[5, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert mask[5, 1].nonzero().flatten().tolist() == [4] and mask[5, 2].nonzero().flatten().tolist() == [5]
    assert all(mask[t, 2, t] for t in range(8))  # every query sees its own key (t < j too)


def test_generated_continuations_are_the_targets_greedy_output():
    """Stage 3's data: training-split prompts, each followed by the checkpoint's greedy
    continuation (made with MTP, which must not change it: checked against num_spec 0)."""
    from mtpkit import LLM, SamplingParams
    from training.train import generate_continuations, sample_generated

    path = resolve_model("tiny-qwen3-next")
    seqs = generate_continuations(path, n=3, prompt_len=16, new_tokens=10, seed=0, log=lambda s: None)
    assert seqs.shape == (3, 26)
    plain = LLM(path, num_spec=0, dtype="float32", enforce_eager=True)
    prompts = seqs[:, :16].tolist()
    outs = plain.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == seqs[:, 16:].tolist()
    windows = sample_generated(seqs, B=5, T=6, g=torch.Generator().manual_seed(0))
    assert windows.shape == (5, 8)
    for w in windows.tolist():  # each window is a contiguous piece of one sequence
        assert any(w == s[o:o + 8] for s in seqs.tolist() for o in range(26 - 8 + 1))


def test_generated_data_needs_a_frozen_target(tmp_path):
    import pytest

    a = TrainArgs(steps=1, generated_fraction=0.5, work_dir=str(tmp_path / "w"), out_dir=str(tmp_path / "o"))
    with pytest.raises(SystemExit, match="needs --init-from and --train-part mtp"):
        train(a, log=lambda s: None)
