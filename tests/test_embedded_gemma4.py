"""The embedded tiny-gemma4 and tiny-gemma4-assistant: both load in transformers 5.24, the
target loads in mtpkit by name and matches transformers (score and greedy, tie-aware), the
assistant drafts in transformers what the training model drafts, and transformers' own
assisted generation reproduces plain greedy with it."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.checkpoint.hub import builtin_models, resolve_model  # noqa: E402
from training.corpus import heldout_prompts  # noqa: E402

TARGET, ASSISTANT = "tiny-gemma4", "tiny-gemma4-assistant"


@pytest.fixture(scope="module")
def hf_pair():
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    t, tinfo = Gemma4ForCausalLM.from_pretrained(resolve_model(TARGET), dtype=torch.float64,
                                                 output_loading_info=True)
    a, ainfo = Gemma4AssistantForCausalLM.from_pretrained(resolve_model(ASSISTANT), dtype=torch.float32,
                                                          output_loading_info=True)
    assert not any(tinfo.values()) and not any(ainfo.values()), (tinfo, ainfo)
    return t.eval(), a.eval()


@pytest.fixture(scope="module")
def prompts():
    return [ids for _, ids in heldout_prompts(3, 96)]


def test_both_are_built_in_and_small():
    assert {TARGET, ASSISTANT} <= set(builtin_models())
    for name in (TARGET, ASSISTANT):
        path = resolve_model(name)
        for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
            assert (path / f).exists(), (name, f)
        assert (path / "model.safetensors").stat().st_size < 16 << 20
    default = json.loads((resolve_model(TARGET) / "mtpkit.json").read_text())["default_drafter"]
    assert default == ASSISTANT
    cfg = json.loads((resolve_model(ASSISTANT) / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_assistant"
    assert cfg["backbone_hidden_size"] == json.loads((resolve_model(TARGET) / "config.json").read_text())["hidden_size"]


def test_target_in_mtpkit_matches_transformers(hf_pair, prompts):
    hf, _ = hf_pair
    llm = LLM(TARGET, dtype="float64", device="cpu", enforce_eager=True)
    ids = prompts[0]
    captured, orig = [], llm.model.compute_logits
    llm.model.compute_logits = lambda h: captured.append(orig(h)) or captured[-1]
    try:
        llm.score(ids)
    finally:
        del llm.model.compute_logits
    ours, ref = torch.cat(captured), O.hf_logits(hf, ids)
    assert ((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max() < 1e-4
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    for p, o in zip(prompts, outs):
        report = O.check_greedy_against_hf(hf, p, o.token_ids)
        assert report.ok, str(report)


def test_assistant_drafts_in_transformers_as_trained(hf_pair, prompts):
    """transformers' drafter loop on the shipped pair = the training model's rounds (float32)."""
    from transformers import Gemma4ForCausalLM, GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    from training import gemma4_assistant as A
    from training import gemma4_target as T
    from training.gemma4_assistant_io import load_assistant
    from training.gemma4_train import load_target

    _, hfa = hf_pair
    hft = Gemma4ForCausalLM.from_pretrained(resolve_model(TARGET), dtype=torch.float32).eval()
    tgt, _ = load_target(resolve_model(TARGET))
    asst = load_assistant(resolve_model(ASSISTANT), tgt)
    k = 4
    for ids in prompts:
        n = len(ids)
        with torch.no_grad():
            out = hft(input_ids=torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True)
            x = torch.cat([torch.tensor([ids]), out.logits[:, -1:].argmax(-1)], 1)
            gen = SinglePositionMultiTokenCandidateGenerator(hfa, hft.get_input_embeddings(),
                                                             GenerationConfig(max_length=n + 16))
            gen.num_assistant_tokens = k
            cand, cand_logits = gen.get_candidates(x, {"attention_mask": torch.ones_like(x)}, out, False, 0)
            hidden, _, cache = T.run_target(tgt, x)
            p = torch.tensor([[n]])
            h, kv, masks = A.rounds_input(tgt, hidden, cache, 1, n + 1, p)
            tok, logits = x[:, n:], []
            for _ in range(k):
                d, h = asst.step(tgt.embed(tok.reshape(-1)).view(1, 1, -1), h, p, kv, masks)
                logits.append(asst.draft_logits(d)[0])
                tok = logits[-1].argmax(-1, keepdim=True)
        torch.testing.assert_close(torch.cat(logits), cand_logits[0], rtol=1e-4, atol=1e-3)
        mine = torch.cat(logits).argmax(-1).tolist()
        # argmax may differ only where the two logits are within rounding of a tie
        assert mine == cand[0, n + 1:].tolist() or torch.cat(logits).topk(2, -1).values.diff().abs().min() < 1e-3


def test_transformers_assisted_generation_equals_greedy(hf_pair, prompts):
    from transformers import Gemma4ForCausalLM

    _, hfa = hf_pair
    hft = Gemma4ForCausalLM.from_pretrained(resolve_model(TARGET), dtype=torch.float32).eval()
    for ids in prompts[:2]:
        x = torch.tensor([ids])
        kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert hft.generate(x, assistant_model=hfa, **kw).tolist() == hft.generate(x, **kw).tolist()


def test_the_pair_is_trained_to_agree():
    """A loose floor on the shipped pair's simulated greedy acceptance (num_spec 3), so a
    broken export or an untrained assistant cannot ship unnoticed (measured: README.md)."""
    from training.gemma4_assistant_io import load_assistant
    from training.gemma4_spec_sim import speculate
    from training.gemma4_train import load_target

    tgt, _ = load_target(resolve_model(TARGET))
    asst = load_assistant(resolve_model(ASSISTANT), tgt)
    prompts = [ids for _, ids in heldout_prompts(4, 96)]
    plain, _ = speculate(tgt, None, prompts, 24, 0)
    out, st = speculate(tgt, asst, prompts, 24, 3)
    assert out == plain and st.mean_acceptance_length > 2.0


def test_engine_acceptance_equals_the_simulation():
    """mtpkit's engine (the target's default drafter, named in mtpkit.json) and the training
    models' simulation of the loop are two implementations of one computation: on the shipped
    pair their greedy tokens and acceptance counts agree (tokens = num_spec 0's)."""
    from training.gemma4_assistant_io import load_assistant
    from training.gemma4_spec_sim import speculate
    from training.gemma4_train import load_target

    tgt, _ = load_target(resolve_model(TARGET))
    asst = load_assistant(resolve_model(ASSISTANT), tgt)
    prompts = [ids for _, ids in heldout_prompts(4, 96)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(TARGET, num_spec=0, dtype="float32", enforce_eager=True).generate(prompts, params)]
    for k in (1, 3):
        llm = LLM(TARGET, num_spec=k, dtype="float32", enforce_eager=True)
        out = [o.token_ids for o in llm.generate(prompts, params)]
        sim, st = speculate(tgt, asst, prompts, 24, k)
        assert out == plain == sim
        assert llm.stats.verify_steps == st.rounds and llm.stats.num_accepted == st.sampled_accepted


def test_mtpkit_with_the_assistant_equals_transformers_assisted_generation(hf_pair, prompts):
    """The same checkpoints, the same prompts: mtpkit's greedy output with the assistant (its
    default drafter, num_spec 3; CPU graphs) equals transformers' assisted greedy output
    (num_assistant_tokens 3) and mtpkit's own without the assistant; a difference is allowed
    only at a near-tie of transformers' float64 logits (tie-aware, as the other greedy checks)."""
    from transformers import Gemma4ForCausalLM

    hft64, hfa = hf_pair
    hft = Gemma4ForCausalLM.from_pretrained(resolve_model(TARGET), dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    spec = LLM(TARGET, num_spec=3, dtype="float32", device="cpu")
    assert spec.draft.name == "gemma4 assistant"
    plain = LLM(TARGET, num_spec=0, dtype="float32", device="cpu")
    ours = [o.token_ids for o in spec.generate(prompts, params)]
    assert ours == [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.stats.mean_acceptance_length > 2.5
    for ids, mine in zip(prompts, ours):
        x = torch.tensor([ids])
        hf_assisted = hft.generate(x, assistant_model=hfa, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   num_assistant_tokens=3)[0, len(ids):].tolist()
        if mine != hf_assisted:
            report = O.check_greedy_against_hf(hft64, ids, mine)
            assert report.ok, str(report)


def test_cli_main_job_on_the_gemma4_pair(capsys):
    from mtpkit import cli

    assert cli.main(["generate", "def fibonacci(n):", "--model", TARGET, "--num-spec", "3", "--max-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert "--- 48 tokens" in out and "num_spec=3: mean acceptance length" in out, out
    assert "acceptance per position [" in out
