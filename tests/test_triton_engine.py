"""The whole engine with the Triton attention backend, run on CPU under the Triton
interpreter, gives the same greedy tokens as the torch backend (MTP on, num_spec 2).

One Triton run only (the interpreter makes each one take a minute): the one with accepted
drafts, which also reads the states of prev_num_emitted 1 that a run of random MTP weights
reads (its steps accept 0, 1 or 2 drafts), so a separate run with the model's own drafts
would check nothing more.

Random MTP weights almost never draft the target's token, so a run with them only ever
reads the GDN / conv state of prev_num_emitted 1. The second test therefore replaces the
drafts, before each verify step, by the known greedy continuation with some positions
deliberately wrong: verify steps then accept 0, 1 or 2 drafts, and the kernels read the
states at every offset of the speculative contract. Both backends get the same drafts.
Padded rows: 3 prompts run in a step padded to 4 rows (graph sizes 1, 2, 4).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before mtpkit's Triton kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402

import oracle as O  # noqa: E402

CFG = "base"  # [L, L, L, F], GQA 2, GDN ratio 2
MAX_TOKENS = 8
PROMPT_LENS = (5, 11, 3)
VOCAB = O.TINY_CONFIGS[CFG]["vocab_size"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_mtp")
    model = O.build_hf_model(CFG, seed=0, dtype=torch.float32)
    O.save_checkpoint(model, path, mtp_state=O.make_mtp_state_dict(CFG, seed=0))
    return path


@pytest.fixture(scope="module")
def prompts():
    return [O.random_prompt(n, VOCAB, seed=n) for n in PROMPT_LENS]


def _generate(path, prompts, backend):
    import mtpkit
    from mtpkit.sampling.params import SamplingParams

    llm = mtpkit.LLM(path, dtype="float32", num_spec=2, attn_backend=backend, max_num_seqs=4,
                     max_model_len=64, graph_sizes=[1, 2, 4])
    assert llm.model.layers[0].linear_attn.ops.name == backend  # the backend really in use
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs], llm.stats


@pytest.fixture(scope="module")
def torch_greedy(checkpoint, prompts):
    return _generate(checkpoint, prompts, "torch")[0]


def _oracle_drafts(monkeypatch, prompts, greedy):
    """Before every verify step, drafts = the greedy continuation, wrong wherever
    (position + j) % 3 == 0, so acceptance lengths vary between steps and requests."""
    from mtpkit.engine.runner import ModelRunner

    expected = {tuple(p): p + g for p, g in zip(prompts, greedy)}
    original = ModelRunner._verify

    def verify(self, plan):
        for r in plan.reqs:
            seq = expected[tuple(r.prompt_token_ids)]
            n = r.num_tokens
            drafts = []
            for j in range(len(r.drafts)):
                tok = seq[n + j] if n + j < len(seq) else 0
                drafts.append((tok + 1) % VOCAB if (n + j) % 3 == 0 else tok)
            r.drafts = drafts
        return original(self, plan)

    monkeypatch.setattr(ModelRunner, "_verify", verify)


def _record_padding(monkeypatch) -> list[tuple[int, int]]:
    """(num_reqs, num_reqs_padded) of every verify step."""
    from mtpkit.engine.runner import ModelRunner

    seen, original = [], ModelRunner._verify

    def verify(self, plan):
        seen.append((plan.num_reqs, plan.num_reqs_padded))
        return original(self, plan)

    monkeypatch.setattr(ModelRunner, "_verify", verify)
    return seen


def test_triton_backend_matches_torch_with_accepted_drafts(checkpoint, prompts, torch_greedy, monkeypatch):
    _oracle_drafts(monkeypatch, prompts, torch_greedy)
    ref_tokens, ref_stats = _generate(checkpoint, prompts, "torch")
    padding = _record_padding(monkeypatch)
    tokens, stats = _generate(checkpoint, prompts, "triton")
    assert any(n < padded for n, padded in padding)  # padded rows ran through the kernels
    assert ref_tokens == torch_greedy  # exact speculative decoding: drafts change nothing
    assert tokens == torch_greedy
    # The drafts really were accepted, at both positions (prev_num_emitted 1, 2 and 3 occurred).
    assert stats.num_accepted > 0 and min(stats.acceptance_rate_per_position) > 0
    assert str(stats) == str(ref_stats)
