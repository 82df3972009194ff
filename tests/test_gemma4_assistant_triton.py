"""The Gemma 4 assistant with the Triton attention backend, on CPU under the Triton
interpreter: the same drafts, tokens and acceptance counts as the torch backend. Its Q-only
layers go through the Triton verify kernel with one query per row, masked as if at p - 1,
over the target's sliding (window W + 1: keys p-W-1..p-1, the blocks below skipped) and full
KV groups; chunked prefill and 3 requests padded to 4 rows."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before mtpkit's Triton kernel modules are imported

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_assistant_oracle as A  # noqa: E402
import oracle as O  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("assistant_triton")
    t = A.bigram_target("dense", 0, 0.1)
    A.save(t.to(torch.float32), root / "target")
    A.save(A.build_assistant("dense", 0, ordered=True, agree_with=t, eps=0.1).to(torch.float32), root / "assistant")
    return root


def _generate(root, backend):
    import mtpkit
    llm = mtpkit.LLM(root / "target", draft_model=root / "assistant", num_spec=3, dtype="float32", device="cpu",
                     attn_backend=backend, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=8,
                     graph_sizes=[1, 2, 4])
    assert llm.drafter.assistant.layers[0].self_attn.ops.name == backend   # the backend really in use
    proposed, propose = [], llm.runner.drafter.propose
    llm.runner.drafter.propose = lambda inp, cache: proposed.append(propose(inp, cache)) or proposed[-1]
    prompts = [O.random_prompt(n, 128, seed=n) for n in (5, 11, 3)]
    outs = llm.generate(prompts, mtpkit.SamplingParams(max_tokens=10, ignore_eos=True))
    return [o.token_ids for o in outs], [d.tolist() for d in proposed], llm.stats


def test_triton_backend_matches_torch(pair):
    tokens, drafts, stats = _generate(pair, "triton")
    ref_tokens, ref_drafts, ref_stats = _generate(pair, "torch")
    assert drafts == ref_drafts
    assert tokens == ref_tokens and stats == ref_stats and stats.num_accepted > 0
