"""The Gemma 4 assistant under tensor parallelism on CPU: two gloo processes (one
`accelerate.debug_launcher` job) against one process, float64. The assistant's query heads
and MLP are split, its vocabulary-parallel head gathered (dense target) or its centroid head
scoring each rank's candidate rows and summing (ordered), while it reads the target's
sharded KV (the dense target's full layers have one KV head, replicated on both ranks). Every
rank proposes the drafts one process proposes, and the tokens and acceptance counts agree.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_assistant_oracle as A  # noqa: E402
import oracle as O  # noqa: E402

# accelerate's launchers meet on a fixed port: this file takes turns with the others that start them (conftest)
pytestmark = pytest.mark.fixed_port

pytest.importorskip("transformers")

CASES = {"dense_ordered": ("dense", True), "moe": ("moe", False)}
F64 = dict(dtype="float64", device="cpu", max_model_len=96, max_num_seqs=3, enforce_eager=True)


def _run(root: Path, case: str, **kw) -> dict:
    from mtpkit import LLM, SamplingParams
    llm = LLM(root / case / "target", draft_model=root / case / "assistant", num_spec=3, **F64, **kw)
    proposed, propose = [], llm.runner.drafter.propose
    llm.runner.drafter.propose = lambda inp, cache: proposed.append(propose(inp, cache)) or proposed[-1]
    prompts = [O.random_prompt(n, 128, seed=80 + n) for n in (2, 11, 31)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    attn = llm.drafter.assistant.layers[-1].self_attn
    return dict(tokens=[o.token_ids for o in outs], drafts=[d.tolist() for d in proposed], stats=llm.stats,
                heads=attn.heads, embed_rows=llm.drafter.assistant.embed_tokens.shape[0])


def _tp2_worker(root: str):
    from accelerate import PartialState
    PartialState._reset_state()   # one inherited through the fork would make this rank a lone process
    state = PartialState(cpu=True)
    torch.set_num_threads(1)
    out = {case: _run(Path(root), case, tensor_parallel_size=2) for case in CASES}
    torch.save(out, Path(root) / f"rank{state.process_index}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("assistant_tp")
    for case, (name, ordered) in CASES.items():
        t = A.bigram_target(name, 0, 0.1)
        A.save(t, root / case / "target")
        A.save(A.build_assistant(name, 0, ordered=ordered, agree_with=t, eps=0.1), root / case / "assistant")
    return root


@pytest.fixture(scope="module")
def tp2(checkpoints):
    from accelerate import debug_launcher
    debug_launcher(_tp2_worker, args=(str(checkpoints),), num_processes=2)
    return [torch.load(checkpoints / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_drafts_and_tokens_equal_tp1(checkpoints, tp2, case):
    ref = _run(checkpoints, case)
    r0, r1 = tp2[0][case], tp2[1][case]
    assert r0["drafts"] == r1["drafts"] == ref["drafts"], "every rank must propose what one process proposes"
    assert r0["tokens"] == r1["tokens"] == ref["tokens"]
    assert r0["stats"] == r1["stats"] == ref["stats"] and ref["stats"].num_accepted > 0
    assert (r0["heads"], ref["heads"]) == (2, 4)                      # the assistant's query heads split
    assert (r0["embed_rows"], ref["embed_rows"]) == (64, 128)         # its vocabulary split
