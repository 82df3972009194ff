"""On the torch backend a proposal's one-token passes run against a scratch copy of their
context (speculative.drafter.scratch_cache) instead of the paged cache: the drafts are the
ones the paged passes make, and a proposal writes each paged cache once (what lets
AOTInductor write it in place instead of copying the whole cache: benchmarks/aot_cache_writes.py).
Both drafters that write KV: the MTP head, and a draft model (tiny-gemma4 drafting for itself:
sliding and full pools, past the 64-token window)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtpkit import LLM, SamplingParams
from mtpkit.speculative import draft_model, mtp

NAME = "tiny-qwen3-next"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):"]


class CacheWrites(TorchDispatchMode):
    """Counts the aten ops that write into the storage of any of `tensors` (an argument its
    schema marks as written)."""

    def __init__(self, tensors):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
        for arg, value in zip(schema, values):
            if (arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor)
                    and value.untyped_storage().data_ptr() in self.storages):
                self.count += 1
        return func(*args, **kwargs)


def record_proposals(llm, monkeypatch, tensors=()):
    """Every proposal's drafts and the number of writes into `tensors` it made."""
    drafter, proposals = llm.runner.drafter, []
    propose = drafter.propose

    def recorded(inp, cache):
        with CacheWrites(tensors) as writes:
            drafts = propose(inp, cache)
        proposals.append((drafts.tolist(), writes.count))
        return drafts

    monkeypatch.setattr(drafter, "propose", recorded)
    return proposals


def record_pass_outputs(llm, monkeypatch):
    """The output hidden state of every MTP pass after the first (the passes that run against
    the scratch): drafts alone would hide a small error, an argmax rarely flips."""
    model, outputs = llm.runner.drafter.model, []
    forward = model.mtp_forward

    def recorded(*args, **kwargs):
        h = forward(*args, **kwargs)
        if kwargs.get("step", 0) > 0:
            outputs.append(h.clone())
        return h

    monkeypatch.setattr(model, "mtp_forward", recorded)
    return outputs


def generate(llm, n=40):
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))]


@pytest.mark.parametrize("num_spec", [2, 4])
def test_mtp_scratch_passes_draft_what_the_paged_passes_draft(monkeypatch, num_spec):
    """Eager, batch of 3 (prefills that draft, verify steps with partial acceptance): the same
    drafts at every proposal and the same tokens, with the paged passes as the reference."""
    llm = LLM(NAME, num_spec=num_spec, enforce_eager=True, enable_prefix_caching=False)
    assert mtp.uses_scratch(llm.runner.drafter.model.ops)
    with monkeypatch.context() as m:
        m.setattr(mtp, "uses_scratch", lambda ops: False)
        ref_proposals, ref_outputs = record_proposals(llm, m), record_pass_outputs(llm, m)
        ref_tokens = generate(llm)
    proposals, outputs = record_proposals(llm, monkeypatch), record_pass_outputs(llm, monkeypatch)
    tokens = generate(llm)
    assert tokens == ref_tokens
    assert len(proposals) >= 5 and [d for d, _ in proposals] == [d for d, _ in ref_proposals]
    assert len(outputs) == len(ref_outputs) == len(proposals) * (num_spec - 1)
    for h, ref in zip(outputs, ref_outputs):
        torch.testing.assert_close(h, ref)
    assert llm.stats.mean_acceptance_length > 1.5   # the drafts are the trained head's, not noise


def test_mtp_proposal_writes_the_paged_cache_once(monkeypatch):
    """K and V of the MTP layer are each written once per proposal (pass 1, every position of the
    step), not once per pass; the counter is not vacuous: the paged passes write num_spec times."""
    num_spec = 3
    llm = LLM(NAME, num_spec=num_spec, enforce_eager=True, enable_prefix_caching=False)
    k, v = llm.cache.kv["mtp"][0]
    proposals = record_proposals(llm, monkeypatch, (k, v))
    generate(llm, 16)
    assert proposals and {w for _, w in proposals} == {2}
    proposals.clear()
    with monkeypatch.context() as m:
        m.setattr(mtp, "uses_scratch", lambda ops: False)
        paged = record_proposals(llm, m, (k, v))
        generate(llm, 16)
    assert {w for _, w in paged} == {2 * num_spec}


def test_draft_model_scratch_passes(monkeypatch):
    """A draft model's passes against the scratch: the same logits at every pass and the same
    drafts as against the paged cache, and each of its paged caches written once per proposal
    (by its forward over the step's tokens) instead of once more per pass."""
    num_spec = 2
    llm = LLM("tiny-gemma4", draft_model="tiny-gemma4", num_spec=num_spec, enforce_eager=True,
              enable_prefix_caching=False)
    caches = [t for g, layers in llm.cache.kv.items() if g.startswith("draft.") for pair in layers for t in pair]
    model, logits = llm.runner.drafter.model, []
    compute_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: logits.append(compute_logits(h)) or logits[-1])
    with monkeypatch.context() as m:
        m.setattr(draft_model, "uses_scratch", lambda ops: False)
        ref_proposals = record_proposals(llm, m, caches)
        ref_tokens = generate(llm, 80)
    ref_logits, logits[:] = list(logits), []
    proposals = record_proposals(llm, monkeypatch, caches)
    tokens = generate(llm, 80)
    assert tokens == ref_tokens and all(len(t) == 80 for t in tokens)
    assert len(proposals) >= 5 and [d for d, _ in proposals] == [d for d, _ in ref_proposals]
    assert len(logits) == len(ref_logits) == len(proposals) * num_spec
    for x, ref in zip(logits, ref_logits):
        torch.testing.assert_close(x, ref)
    writes = {w for _, w in proposals}
    assert len(writes) == 1 and writes.pop() > 0
    assert {w for _, w in ref_proposals} == {(1 + num_spec) * proposals[0][1]}


def test_proposal_context_is_whole_blocks_of_keys(monkeypatch):
    """A proposal's context is rounded up to a multiple of drafter.CTX_MULTIPLE keys (a compiled
    pass packs K^T in 16-column blocks: benchmarks/proposal_context.py); the extra keys lie past
    every query, so the passes' outputs and drafts are the exact-length context's."""
    from mtpkit.speculative import drafter
    num_spec = 3
    # float64: the rounded context adds masked keys to the attention's reductions; in float64 no
    # rounding difference comes near flipping a draft's argmax on any CPU
    llm = LLM(NAME, num_spec=num_spec, enforce_eager=True, enable_prefix_caching=False, dtype="float64")
    lengths = []
    slots_of = mtp.proposal_kv_slots

    def recorded(*args):
        out = slots_of(*args)
        lengths.append((out.shape[2], args[4] + num_spec))   # (its context, max_seq_len + passes)
        return out

    monkeypatch.setattr(mtp, "proposal_kv_slots", recorded)
    with monkeypatch.context() as m:
        m.setattr(drafter, "CTX_MULTIPLE", 1)
        ref_proposals, ref_outputs = record_proposals(llm, m), record_pass_outputs(llm, m)
        ref_tokens = generate(llm)
    assert lengths and all(ctx == exact for ctx, exact in lengths)
    lengths.clear()
    proposals, outputs = record_proposals(llm, monkeypatch), record_pass_outputs(llm, monkeypatch)
    tokens = generate(llm)
    assert lengths and all(ctx % drafter.CTX_MULTIPLE == 0 and exact <= ctx < exact + drafter.CTX_MULTIPLE
                           for ctx, exact in lengths)
    assert any(ctx != exact for ctx, exact in lengths)   # rounded somewhere, or the comparison is vacuous
    assert tokens == ref_tokens
    assert len(proposals) >= 5 and [d for d, _ in proposals] == [d for d, _ in ref_proposals]
    assert len(outputs) == len(ref_outputs) == len(proposals) * (num_spec - 1)
    for h, ref in zip(outputs, ref_outputs):
        torch.testing.assert_close(h, ref)
