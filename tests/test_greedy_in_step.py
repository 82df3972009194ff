"""An all-greedy verify step without controls takes its outcome from inside the verify body
(sampling/rejection.greedy_verify: the argmax, the drafts' accepted prefix and the finite check,
read back as one int tensor) instead of sampling the logits eagerly. Both must decide alike:
the rule against a plain-Python statement of it and against the eager rejection on random
logits and drafts (non-finite positions, ties, padded rows with draft limit 0), traced too; and
an LLM's greedy tokens on the fast path equal to enforce_eager's with the eager rejection, both
families, num_spec 0 and 3, batch 1 and 8. A step of plain greedy rows runs no tensor op on the
host but its read-backs (the proposal reads the verify graph's outcome where the graph wrote it)."""

import math

import pytest
import torch

from mtpkit import LLM, SamplingParams
from mtpkit.engine import runner as runner_module
from mtpkit.sampling.rejection import greedy_verify, rejection_sample
from mtpkit.sampling.sampler import SamplingTensors


def _reference(logits, drafts, limit) -> list[list[int]]:
    """The rule in plain Python: the first argmax per position; 1 + the drafts before the first
    that differs from the target's token or passes the limit; 1 where the max is finite."""
    out = []
    for row, d, lim in zip(logits.tolist(), drafts.tolist(), limit.tolist()):
        target = []
        for pos in row:
            nan = [i for i, x in enumerate(pos) if math.isnan(x)]   # argmax treats NaN as the max
            target.append(nan[0] if nan else max(range(len(pos)), key=lambda i: (pos[i], -i)))
        n = 1
        while n - 1 < min(lim, len(d)) and d[n - 1] == target[n - 1]:
            n += 1
        finite = [int(not any(math.isnan(x) for x in pos) and math.isfinite(max(pos))) for pos in row]
        out.append(target + [n] + finite)
    return out


def _eager(logits, drafts, limit) -> torch.Tensor:
    R = logits.shape[0]
    tokens, num = rejection_sample(logits, drafts, limit, SamplingTensors.from_params([SamplingParams()] * R, "cpu"),
                                   [None] * R, [0] * R)
    return torch.cat([tokens, num[:, None], torch.isfinite(logits.amax(-1)).long()], dim=1)


def _case(g, R: int, k: int, V: int = 7):
    logits = torch.randn(R, k + 1, V, generator=g, dtype=torch.float64)
    ties = torch.rand(R, k + 1, generator=g) < 0.2             # two equal maxima: the first wins
    logits[..., 3] = torch.where(ties, logits.amax(-1) + 1, logits[..., 3])
    logits[..., 5] = torch.where(ties, logits[..., 3], logits[..., 5])
    kind = torch.randint(0, 12, (R, k + 1), generator=g)       # some positions not finite
    logits[..., 2] = torch.where(kind == 0, math.nan, logits[..., 2])
    logits[..., 4] = torch.where(kind == 1, math.inf, logits[..., 4])
    logits[kind == 2] = -math.inf
    target = logits.argmax(-1)
    right = torch.rand(R, k, generator=g) < 0.7                # mostly accepted, so prefixes vary
    drafts = torch.where(right, target[:, :k], torch.randint(0, V, (R, k), generator=g))
    limit = torch.randint(0, k + 1, (R,), generator=g)         # 0: a padded row, or a request at its end
    return logits, drafts, limit


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.jit.trace's, as graphs/captured.py hides it
@pytest.mark.parametrize("k", [0, 1, 3])
def test_greedy_verify_is_the_eager_rejection(k):
    g = torch.Generator().manual_seed(k)
    traced = None
    for trial in range(24):
        logits, drafts, limit = _case(g, 1 + trial % 8, k)
        got = greedy_verify(logits, drafts, limit)
        assert got.tolist() == _reference(logits, drafts, limit)
        assert torch.equal(got, _eager(logits, drafts, limit))
        if trial % 8 == 7:   # traced once at 8 rows, replayed on later inputs: nothing frozen
            if traced is None:
                traced = torch.jit.trace(greedy_verify, (logits, drafts, limit), check_trace=False)
            else:
                assert torch.equal(traced(logits, drafts, limit), got)


MODELS = {"tiny-qwen3-next": None, "tiny-gemma4": "tiny-gemma4-assistant"}
_LLMS: dict = {}


def _llm(name: str, k: int, eager: bool) -> LLM:
    key = (name, k, eager)
    if key not in _LLMS:
        llm = _LLMS[key] = LLM(name, draft_model=MODELS[name] if k else None, num_spec=k, dtype="float64",
                               max_num_seqs=8, max_model_len=96, enforce_eager=eager)
        if eager:
            llm.runner.greedy_in_step = False    # every verify step through rejection_sample
        else:
            llm.runner.graphs.trace_after = 0    # traced from the first decode step
    return _LLMS[key]


def _counted(monkeypatch, llm: LLM) -> dict:
    """Calls of rejection_sample and of prefill steps while `llm` generates."""
    calls = {"rejection": 0, "prefill": 0}
    real, prefill = runner_module.rejection_sample, llm.runner._prefill

    def counted(*a, **kw):
        calls["rejection"] += 1
        return real(*a, **kw)

    def counted_prefill(plan):
        calls["prefill"] += 1
        return prefill(plan)
    monkeypatch.setattr(runner_module, "rejection_sample", counted)
    monkeypatch.setattr(llm.runner, "_prefill", counted_prefill)
    return calls


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("k", [0, 3])
def test_fast_path_greedy_equals_eager(monkeypatch, name, k):
    fast, eager = _llm(name, k, eager=False), _llm(name, k, eager=True)
    texts = ["def fibonacci(n):", "The capital of", "import torch\n", "1, 2, 3, 5, 8,", "Once upon",
             "class Node:\n    def", "SELECT * FROM", "# mtpkit"]
    prompts = [fast.tokenizer.encode(t).ids for t in texts]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        with monkeypatch.context() as m:
            calls = _counted(m, fast)
            got = [o.token_ids for o in fast.generate(batch, sp)]
        # the verify steps took the in-step outcome: only the prefills sampled eagerly
        assert calls["prefill"] > 0 and calls["rejection"] <= calls["prefill"]
        with monkeypatch.context() as m:
            calls = _counted(m, eager)
            want = [o.token_ids for o in eager.generate(batch, sp)]
        assert calls["rejection"] > calls["prefill"]
        assert got == want, (name, k, len(batch))
    assert fast.runner.graphs.verify_graphs, "the decode steps were meant to replay traces"


class _HostCalls(torch.overrides.TorchFunctionMode):
    """The torch functions and tensor methods called from Python (what a replayed graph runs
    inside it is not seen)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("k", [0, 3])
def test_plain_greedy_step_runs_no_host_tensor_op_but_its_read_backs(name, k):
    """A verify step whose rows are all plain greedy (no controls, logprobs or grammar), replayed
    from traces: the host reads back the verify graph's outcome (and the proposal's drafts) and
    runs no other tensor op, since each op after a graph runs with the caches cold (~10 us): the
    proposal reads what the verify graph emitted from the buffers the graph wrote. The tokens stay
    the eager engine's (test_fast_path_greedy_equals_eager)."""
    llm = LLM(name, draft_model=MODELS[name] if k else None, num_spec=k, dtype="float64", max_num_seqs=2,
              max_model_len=96, enable_prefix_caching=False)   # (no state snapshots: their copies are host ops)
    llm.runner.graphs.trace_after = 0
    prompts = [llm.tokenizer.encode(t).ids for t in ("def fibonacci(n):", "The capital of")]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, sp)]   # traces every graph these steps replay
    steps, real = [], llm.runner.execute

    def execute(plan):
        with _HostCalls() as calls:
            out = real(plan)
        steps.append((plan.kind.value, calls.names))
        return out
    llm.runner.execute = execute
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    verify = [names for kind, names in steps if kind == "verify"]
    assert len(verify) >= 3
    read_backs = ["tolist"] * (2 if k else 1)   # the verify outcome, then the drafts
    assert all(names == read_backs for names in verify), verify
    # a step with a row asking for logprobs makes its tokens' tensors on the host
    steps.clear()
    llm.generate(prompts, [sp, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)])
    assert all(len(names) > len(read_backs) for kind, names in steps if kind == "verify")


CONTROLS = {
    "penalties": dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
    "min_tokens and logit_bias": dict(min_tokens=6, logit_bias={11: 3.0, 13: -2.0}),
    "single-token bad words": dict(bad_words=[[11], [13], [220]]),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_greedy_controlled_steps_take_the_controls_graphs_outcome(monkeypatch, name, control):
    """An all-greedy step whose logits only the captured controls processed reads the controls
    graph's greedy outcome (sampling/rejection.controlled_greedy_verify) instead of sampling the
    processed logits eagerly: the same tokens as enforce_eager's eager rejection, no
    rejection_sample in its verify steps, the same drafts, and the same tokens as without drafts. A
    multi-token bad word (banned on the host after the graph) takes the eager path."""
    fast, eager = _llm(name, 3, eager=False), _llm(name, 3, eager=True)
    prompts = [fast.tokenizer.encode(t).ids for t in ("def fibonacci(n):", "The capital of", "import torch\n")]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **CONTROLS[control])
    with monkeypatch.context() as m:
        calls = _counted(m, fast)
        outs = fast.generate(prompts, sp)
    assert calls["prefill"] > 0 and calls["rejection"] <= calls["prefill"]   # the verify steps sampled nothing eagerly
    want = eager.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    # the drafts too (the proposal read the controlled outcome the controls graph left for it):
    # where each token came from, accepted draft or the target's own
    assert [o.token_draft_positions for o in outs] == [o.token_draft_positions for o in want]
    # and the drafts change nothing: the same tokens without them (float64)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _llm(name, 0, eager=False).generate(prompts, sp)]
    words = CONTROLS[control].get("bad_words", []) + [[28, 11]]   # a two-token bad word: banned on the host
    multi = SamplingParams(max_tokens=12, ignore_eos=True, **{**CONTROLS[control], "bad_words": words})
    with monkeypatch.context() as m:
        calls = _counted(m, fast)
        got = [o.token_ids for o in fast.generate(prompts, multi)]
    assert calls["rejection"] > calls["prefill"]
    assert got == [o.token_ids for o in eager.generate(prompts, multi)]
