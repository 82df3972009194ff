"""Every step path under mtpkit.debug() (each jaxtyping boundary checked by beartype, the step
bodies called on the static buffers, a shape trace recorded): one engine per family and num_spec
runs a batch that mixes what users ask for (greedy, seeded sampling with top-k / top-p / min-p,
penalties, logprobs and prompt logprobs, n=2, a stop string, a multi-token bad word, a grammar;
and without drafts, decode runs of num_scheduler_steps) and must generate what it generates
outside debug mode. A wrong annotation on any boundary these paths cross fails here (it did:
the sample body's return, typed with a dimension no argument named, crashed debug mode on a
sampled step)."""

import pytest

import mtpkit
from mtpkit import LLM, SamplingParams, StructuredOutputs

DRAFTERS = {"tiny-qwen3-next": None, "tiny-gemma4": "tiny-gemma4-assistant"}
TEXTS = ["def fibonacci(n):", "The capital of", "import torch\n", "1, 2, 3, 5, 8,", "Once upon",
         "class Node:\n    def"]


def _params(tokenizer) -> list[SamplingParams]:
    base = dict(max_tokens=10, ignore_eos=True)
    return [
        SamplingParams(**base),
        SamplingParams(**base, temperature=1.6, seed=3, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(**base, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1),
        SamplingParams(**base, logprobs=2, prompt_logprobs=1),
        SamplingParams(**base, temperature=1.8, seed=5, n=2, stop=["\n\n"],
                       bad_words=[tokenizer.decode(tokenizer.encode(" return x").ids)]),
    ]


def _outs(outputs) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, [sorted(d) for d in c.logprobs or []]) for o in outputs for c in o.outputs]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("k", [0, 3])
def test_every_step_path_under_debug_mode_checks_its_shapes(name, k):
    llm = LLM(name, num_spec=k, draft_model=DRAFTERS[name] if k else None, dtype="float64", max_num_seqs=8,
              max_model_len=128, num_scheduler_steps=1 if k else 4)
    llm.runner.graphs.trace_after = 0
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    calls = [(TEXTS[:5], _params(llm.tokenizer)),   # the sample graph (a step with a grammar row samples eagerly)
             (TEXTS[:2], [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.6, seed=9, top_p=0.9),
                          greedy]),                  # ... and without any control
             (TEXTS[:2], [SamplingParams(max_tokens=12, structured_outputs=StructuredOutputs(
                 choice=["yes", "no", "maybe"])), greedy]),
             (TEXTS[:3], [greedy] * 3)]              # plain greedy: decode runs without drafts
    want = [_outs(llm.generate(prompts, params)) for prompts, params in calls]
    with mtpkit.debug() as trace:
        got = [_outs(llm.generate(prompts, params)) for prompts, params in calls]
    assert got == want
    seen = {e.function.rsplit(".", 1)[-1] for e in trace}
    assert {"sampled_verify", "apply_controls", "apply_token_bitmask_", "processed_logprobs"} <= seen, seen
    if k:
        assert "greedy_verify" in seen
    else:
        assert "advance_decode" in seen                             # the greedy rows' decode runs
