"""A verify step with random rows (temperature > 0) and no grammar samples inside a captured graph
(CapturedSteps.sample: the sample body, sampling/rejection.sampled_verify) instead of running
rejection_sample eagerly on the host. Both must decide alike: sampled_verify against
rejection_sample on random logits, drafts and settings (greedy, temperature, top-k, top-p, min-p
rows; non-finite positions; processed logits with banned tokens), traced too; a row's p not
depending on what the other rows of its batch ask; an LLM's seeded tokens with the sample graph
equal to enforce_eager's eager rejection (both families, num_spec 0 and 3, batch 1 and 8, with
generation controls and logprobs), whatever the batch; and such a step runs no tensor op on the
host but its read-backs."""

import math

import pytest
import torch

from mtpkit import LLM, SamplingParams
from mtpkit.sampling.rejection import rejection_sample, sampled_verify
from mtpkit.sampling.sampler import (Filters, SamplingTensors, exponential_noise, keyed_positions, noise_steps,
                                     sampling_rows, target_probs)

from test_greedy_in_step import MODELS, _counted, _HostCalls, _llm   # (float64; eager: rejection_sample)


def _params(g, R: int) -> list[SamplingParams]:
    """Rows of every kind: greedy, plain temperature, top-k, top-p, min-p and their mixes."""
    out = []
    for i in range(R):
        kind = int(torch.randint(0, 6, (1,), generator=g))
        if kind == 0:
            out.append(SamplingParams())
            continue
        t = float(torch.rand(1, generator=g)) * 1.5 + 0.2
        out.append(SamplingParams(temperature=t, top_k=[0, 3, 0, 2, 0, 4][kind], top_p=[1.0, 1.0, 0.7, 0.9, 1.0, 0.5][kind],
                                  min_p=[0.0, 0.0, 0.0, 0.1, 0.2, 0.0][kind]))
    return out


def _case(g, R: int, k: int, V: int = 11, dtype=torch.float64):
    logits = torch.randn(R, k + 1, V, generator=g, dtype=dtype) * 2
    kind = torch.randint(0, 16, (R, k + 1), generator=g)       # some positions not finite
    logits[..., 2] = torch.where(kind == 0, math.nan, logits[..., 2])
    logits[..., 4] = torch.where(kind == 1, math.inf, logits[..., 4])
    processed = logits.clone()
    processed[..., 5] = torch.where(kind == 2, -math.inf, processed[..., 5])   # a control's ban
    processed[kind == 3] = -math.inf                                            # ... of every token
    params = _params(g, R)
    seeds = [None if p.temperature == 0 else int(torch.randint(0, 2**62, (1,), generator=g)) for p in params]
    start = torch.randint(0, 50, (R,), generator=g)
    positions = start[:, None] + torch.arange(k + 1)
    st = SamplingTensors.from_params(params, "cpu")
    # the eager targets, so that most drafts are accepted and prefixes vary
    target, _ = rejection_sample(processed, torch.zeros(R, k, dtype=torch.int64), torch.zeros(R, dtype=torch.int64),
                                 st, seeds, start.tolist())
    right = torch.rand(R, k, generator=g) < 0.7
    drafts = torch.where(right, target[:, :k], torch.randint(0, V, (R, k), generator=g))
    limit = torch.randint(0, k + 1, (R,), generator=g)
    return logits, processed, drafts, limit, params, seeds, positions


def _in_graph(logits, processed, drafts, limit, params, seeds, positions, filters=None):
    floats, ints = sampling_rows(params, seeds)
    floats, ints = torch.tensor(floats, dtype=torch.float32), torch.tensor(ints, dtype=torch.int64)
    filters = Filters.of(params)._replace(greedy=True) if filters is None else filters
    st = SamplingTensors.from_buffers(floats, ints, filters)
    return sampled_verify(logits, processed, drafts, limit, st, ints[2], positions, noise_steps(logits.shape[-1], "cpu"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.jit.trace's, as graphs/captured.py hides it
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sampled_verify_is_the_eager_rejection(k, dtype):
    g = torch.Generator().manual_seed(10 + k)
    traced = {}
    for trial in range(24):
        R = 1 + trial % 8
        logits, processed, drafts, limit, params, seeds, positions = _case(g, R, k, dtype=dtype)
        got = _in_graph(logits, processed, drafts, limit, params, seeds, positions)
        tokens, num = rejection_sample(processed, drafts, limit, SamplingTensors.from_params(params, "cpu"), seeds,
                                       positions[:, 0].tolist())
        B = k + 1
        finite = torch.isfinite(logits.amax(-1)).long()
        live = torch.isfinite(processed.amax(-1)).long()
        # the tokens count only where they decide the step: up to num_emitted, at finite positions
        # (a row not finite or without a live token there ends its request)
        for i in range(R):
            e = int(num[i])
            assert int(got[i, B]) == e
            ok = bool(finite[i, :e].all() and live[i, :e].all())
            if ok:
                assert got[i, :e].tolist() == tokens[i, :e].tolist(), (trial, i)
        assert torch.equal(got[:, B + 1:2 * B + 1], finite)
        assert torch.equal(got[:, 2 * B + 1:], live)
        # traced with all filters on, replayed on later rows of the same size: nothing frozen, and a
        # row's tokens do not depend on which filters the graph runs
        if R == 8:
            every = Filters(True, True, True, True)
            args = (logits, processed, drafts, limit, params, seeds, positions)
            floats, ints = (torch.tensor(x, dtype=d) for x, d in zip(sampling_rows(params, seeds),
                                                                      (torch.float32, torch.int64)))

            def body(lg, pr, dr, lim, fl, it, pos, steps):
                return sampled_verify(lg, pr, dr, lim, SamplingTensors.from_buffers(fl, it, every), it[2], pos, steps)
            tensors = (logits, processed, drafts, limit, floats, ints, positions, noise_steps(logits.shape[-1], "cpu"))
            if "fn" not in traced:
                traced["fn"] = torch.jit.trace(body, tensors, check_trace=False)
            assert torch.equal(traced["fn"](*tensors)[:, :B + 1], _in_graph(*args, filters=every)[:, :B + 1])
            assert torch.equal(_in_graph(*args, filters=every)[:, :B + 1], got[:, :B + 1])


def test_a_rows_p_does_not_depend_on_its_batch():
    """target_probs runs top-p (top-k, min-p) for a step if any row asks, so a row that does not ask
    must pass through unchanged: a top_p=1 row keeps its whole distribution, even where the float32
    cumulative sum reaches 1.0 before its tail (planted: without that guard the tail is dropped)."""
    V = 64
    row = torch.full((V,), -40.0, dtype=torch.float64)
    row[0] = 0.0                     # p ~ 1 - 63 * e^-40: the cumulative sum is 1.0 in float32 after it
    logits = torch.stack([row, torch.randn(V, dtype=torch.float64)])[:, None, :]
    alone = target_probs(logits[:1], SamplingTensors.from_params([SamplingParams(temperature=1.0)], "cpu"))
    mixed = target_probs(logits, SamplingTensors.from_params(
        [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5, top_k=5, min_p=0.1)], "cpu"))
    assert bool((alone[0, 0, 1:] > 0).all())
    assert bool((mixed[0, 0, 1:] > 0).all()), "a top_p=1 row lost its tail to another row's top-p"
    torch.testing.assert_close(mixed[0], alone[0], rtol=1e-6, atol=0)


def _mixed_params(max_tokens: int = 12) -> list[SamplingParams]:
    base = dict(max_tokens=max_tokens, ignore_eos=True)
    return [SamplingParams(**base, temperature=0.8, seed=1),
            SamplingParams(**base, temperature=1.2, seed=2, top_k=5, top_p=0.9),
            SamplingParams(**base),                                              # greedy, in a sampled step
            SamplingParams(**base, temperature=0.7, seed=3, min_p=0.1, repetition_penalty=1.2),
            SamplingParams(**base, temperature=1.0, seed=4, logprobs=2),
            SamplingParams(**base, temperature=0.9, seed=5, top_p=0.8, presence_penalty=0.5),
            SamplingParams(**base, temperature=0.6),                             # its seed derived
            SamplingParams(**base, temperature=1.0, seed=7, logit_bias={11: 2.0})]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("k", [0, 3])
def test_sampled_steps_in_the_graph_equal_the_eager_rejection(monkeypatch, name, k):
    fast, eager = _llm(name, k, eager=False), _llm(name, k, eager=True)
    texts = ["def fibonacci(n):", "The capital of", "import torch\n", "1, 2, 3, 5, 8,", "Once upon",
             "class Node:\n    def", "SELECT * FROM", "# mtpkit"]
    prompts = [fast.tokenizer.encode(t).ids for t in texts]
    params = _mixed_params()
    params[6] = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.6, seed=6)
    for batch in (slice(0, 1), slice(3, 4), slice(0, 8)):
        with monkeypatch.context() as m:
            calls = _counted(m, fast)
            got = fast.generate(prompts[batch], params[batch])
        # the verify steps sampled in their graph: only the prefills ran the eager rejection
        assert calls["prefill"] > 0 and calls["rejection"] <= calls["prefill"], (name, k, batch)
        want = eager.generate(prompts[batch], params[batch])
        assert [o.token_ids for o in got] == [o.token_ids for o in want], (name, k, batch)
        assert [o.token_draft_positions for o in got] == [o.token_draft_positions for o in want]
        for a, b in zip(got, want):   # logprobs of the sampled tokens, from the same logits
            if a.logprobs is not None:
                for x, y in zip(a.logprobs, b.logprobs):
                    assert x.keys() == y.keys()
                    for t in x:
                        assert math.isclose(x[t].logprob, y[t].logprob, rel_tol=1e-9, abs_tol=1e-9)
    keys = fast.runner.graphs.sample_graphs
    assert keys, "the sampled steps were meant to replay a traced sample graph"
    # traced graphs run the parts the step asks for: the first batch's temperature-only row runs none
    assert (1, Filters(False, False, False, True), False) in keys, sorted(keys)
    # seeded rows sample the same tokens whatever the batch and the drafts (float64)
    alone = [fast.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]
    assert alone == [o.token_ids for o in fast.generate(prompts, params)]
    assert alone == [o.token_ids for o in _llm(name, 0 if k else 3, eager=False).generate(prompts, params)]


CONTROLLED = dict(repetition_penalty=1.2, presence_penalty=0.3, min_tokens=3, logit_bias={11: 1.5})


@pytest.mark.parametrize("rows", ["sampled", "greedy, controlled", "sampled, controlled"])
def test_sampled_step_runs_no_host_tensor_op_but_its_read_backs(rows):
    """A verify step with a random row (or a generation control), replayed from traces: the sample
    graph reads the rows' settings from buffers written only when the step's requests change, the
    controls graph its rows' inputs and the penalised rows' new counts written through numpy (no
    tensor op), and each writes its outcome where the proposal reads it, so the host reads back the
    outcome and the drafts and runs no other tensor op. A row asking for logprobs needs the tokens
    as tensors."""
    name, k = "tiny-qwen3-next", 3
    llm = LLM(name, num_spec=k, dtype="float64", max_num_seqs=2, max_model_len=96, enable_prefix_caching=False)
    llm.runner.graphs.trace_after = 0
    prompts = [llm.tokenizer.encode(t).ids for t in ("def fibonacci(n):", "The capital of")]
    base = dict(max_tokens=16, ignore_eos=True)
    second = {"sampled": dict(temperature=0.8, seed=1), "greedy, controlled": CONTROLLED,
              "sampled, controlled": dict(temperature=0.8, seed=1, top_k=20, **CONTROLLED)}[rows]
    sps = [SamplingParams(**base), SamplingParams(**base, **second)]
    want = [o.token_ids for o in llm.generate(prompts, sps)]   # traces every graph these steps replay
    steps, real = [], llm.runner.execute

    def execute(plan):
        with _HostCalls() as calls:
            out = real(plan)
        steps.append((plan.kind.value, calls.names, plan.num_reqs))
        return out
    llm.runner.execute = execute
    got = [o.token_ids for o in llm.generate(prompts, sps)]
    assert got == want
    verify = [names for kind, names, _ in steps if kind == "verify"]
    assert len(verify) >= 3
    assert all(names == ["tolist", "tolist"] for names in verify), verify
    # switched off, the same steps run the eager rejection on the host, to the same tokens
    steps.clear()
    llm.runner.sample_in_step = llm.runner.greedy_in_step = False
    assert [o.token_ids for o in llm.generate(prompts, sps)] == want
    assert all(len(names) > 2 for kind, names, _ in steps if kind == "verify")
    steps.clear()
    llm.runner.sample_in_step = llm.runner.greedy_in_step = True
    sps[0] = SamplingParams(**base, logprobs=1)
    llm.generate(prompts, sps)
    both = [names for kind, names, num_reqs in steps if kind == "verify" and num_reqs == 2]
    assert both and all(len(names) > 2 for names in both)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.jit's, raised while inductor compiles
@pytest.mark.filterwarnings("ignore::FutureWarning")        # torch.export's pytree, in torch 2.13
@pytest.mark.parametrize("controlled", [False, True])
def test_compiled_sample_graph_equals_the_eager_body(tmp_path, controlled):
    """The sample graph compiled for real (AOTInductor, as LLM(compile="aot") compiles it: a few
    seconds for this small graph) draws what the body draws eagerly and writes it where the
    proposal reads it, at tiny-qwen3-next's vocabulary of 257 (not a multiple of a vector's
    width). Inductor miscompiled the noise when the graph made its arange-times-constant steps
    itself (wrong tokens past the vocabulary, writes out of bounds): the body takes them as an
    argument (sampler.noise_steps). Tokens are compared where the draw is not a near-tie (see
    clear_rows: bitwise equality of compiled and eager floats is not promised on every CPU)."""
    import types

    from mtpkit.engine.step_bodies import StepBodies
    from mtpkit.graphs.captured import CapturedSteps
    from mtpkit.graphs.compiled import Compiler
    n, B, V = 2, 4, 257
    bodies = StepBodies.__new__(StepBodies)
    bodies.bundle, bodies.has_drafter = B, True
    steps_obj = types.SimpleNamespace(bundle=B, bodies=bodies)
    filters = Filters(True, True, True, True)
    fn = CapturedSteps._sample_fn(steps_obj, filters, controlled)
    g = torch.Generator().manual_seed(5)

    def args_of(trial):
        logits = torch.randn(n * B, V, generator=g) * 3
        processed = (logits.view(n, B, V) - 4 * (torch.rand(n, B, V, generator=g) < 0.3)).contiguous()
        params = [SamplingParams(temperature=0.9, top_k=[0, 30][trial % 2], top_p=[0.8, 1.0][trial % 2],
                                 min_p=[0.0, 0.02][trial % 2]), SamplingParams()]
        floats, ints = sampling_rows(params, [trial * 7919 + 2**40, None])
        front = (logits, processed) if controlled else (logits,)
        return front + (torch.randint(0, V, (n * B,), generator=g), torch.arange(n * B) + 40 * trial,
                        torch.tensor([B - 1, 1]), torch.tensor(floats, dtype=torch.float32), torch.tensor(ints),
                        noise_steps(V, "cpu"), torch.zeros(n * B, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    def clear_rows(a) -> torch.Tensor:
        """Rows whose every draw wins by a clear margin (the best p/E at least 1e-4 above the next):
        compiled code may round p by an ulp (fused softmax, other CPUs' vector widths), which can
        only flip a near-tie; elsewhere the draws must agree."""
        logits, rest = a[0], a[2:] if controlled else a[1:]
        processed = a[1] if controlled else logits.view(n, B, V)
        positions, floats, ints, steps = rest[1], rest[3], rest[4], rest[5]
        prob = target_probs(processed, SamplingTensors.from_buffers(floats, ints, filters)).double()
        ratio = prob * exponential_noise(keyed_positions(ints[2], positions.view(n, B) + 1), V, steps).reciprocal()
        top = ratio.topk(2, dim=-1).values
        return ((top[..., 0] - top[..., 1]) > 1e-4 * top[..., 0]).all(-1)
    compiled = Compiler("aot", [torch.nn.Linear(1, 1)], cache_dir=tmp_path).compile(fn, args_of(0), "sample_test")
    checked_rows = 0
    for trial in range(6):
        a = args_of(trial)
        b = tuple(x.clone() for x in a)
        want, got = fn(*a), compiled(*b)
        assert int(got[:, :B].min()) >= 0 and int(got[:, :B].max()) < V, trial   # (the miscompile's symptom)
        assert torch.equal(got[:, B + 1:], want[:, B + 1:]), trial                 # finite, live
        clear = clear_rows(a)
        assert torch.equal(got[clear], want[clear]), trial                         # tokens, num_emitted
        checked_rows += int(clear.sum())
        # what the proposal reads: the compiled graph's own outcome, written in place
        assert torch.equal(b[-2].view(n, B), got[:, :B]) and torch.equal(b[-1], got[:, B])
        assert not torch.equal(b[-2], torch.zeros_like(b[-2]))
    assert checked_rows >= 6, checked_rows   # most rows are clear: the comparison is not vacuous


def test_callers_on_threads_sample_in_the_graph_as_the_serial_run():
    """Four threads on one engine with graphs, their calls mixing seeded sampling, top-k / top-p,
    penalties, logprobs and greedy rows: the steps batch the callers' requests together (the sample
    graph's buffers are rewritten when a step's requests change) and every call gets the serial
    run's tokens (float64, seeded: a row's draws do not depend on its batch)."""
    import threading

    from test_concurrency import assert_mixed

    llm = _llm("tiny-qwen3-next", 3, eager=False)
    texts = ["def fibonacci(n):", "The capital of", "import torch\n", "1, 2, 3, 5, 8,", "Once upon",
             "class Node:\n    def", "SELECT * FROM", "# mtpkit"]
    # hot temperatures: the trained model is so sure of its next token that temperatures near 1
    # mostly draw its argmax, and would not tell one row's settings from another's
    base = dict(max_tokens=10, ignore_eos=True)
    params = [SamplingParams(**base), SamplingParams(**base, temperature=1.8, seed=1),
              SamplingParams(**base, temperature=2.0, seed=2, top_k=20), SamplingParams(**base, temperature=1.5, seed=3,
                                                                                       repetition_penalty=1.2),
              SamplingParams(**base, temperature=1.7, seed=4, top_p=0.95, logprobs=1),
              SamplingParams(**base, repetition_penalty=1.3),
              SamplingParams(**base, temperature=2.0, seed=5, min_p=0.02),
              SamplingParams(**base, temperature=1.9, seed=6, presence_penalty=0.5)]
    calls = [([llm.tokenizer.encode(texts[2 * c + j]).ids for j in range(2)], params[2 * c:2 * c + 2]) for c in range(4)]
    serial = [[o.token_ids for o in llm.generate(p, sp)] for p, sp in calls]
    since, got, errors, owner = llm.engine.step_log.num_steps, {}, [], {}
    real_add = llm.engine.add

    def add(*a, **kw):   # which caller queued each request (for the step log)
        r = real_add(*a, **kw)
        owner[r.req_id] = threading.current_thread().name
        return r
    llm.engine.add = add

    def caller(c):
        try:
            got[c] = [o.token_ids for o in llm.generate(*calls[c])]
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
    try:
        threads = [threading.Thread(target=caller, args=(c,), name=f"caller{c}") for c in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        llm.engine.add = real_add
    assert not errors, errors
    assert [got[c] for c in range(4)] == serial
    assert_mixed(llm, since, owner)


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_steps_in_debug_mode_check_their_shapes(k):
    """In debug mode (every boundary checked, the bodies called on the static buffers) a sampled
    step, with and without a generation control, runs the sample body and gives the tokens it gives
    unchecked."""
    import mtpkit

    prompts = [[3, 17, 5, 9, 30, 2, 11, 8], [4, 4, 21, 7]]
    base = dict(max_tokens=8, ignore_eos=True)
    sps = [SamplingParams(**base, temperature=1.5, seed=1, top_k=30),
           SamplingParams(**base, temperature=1.2, seed=2)]
    controlled = [SamplingParams(**base, temperature=1.5, seed=1, repetition_penalty=1.3), sps[1]]
    llm = _llm("tiny-qwen3-next", k, eager=False)
    want = [[o.token_ids for o in llm.generate(prompts, p)] for p in (sps, controlled)]
    with mtpkit.debug() as trace:
        got = [[o.token_ids for o in llm.generate(prompts, p)] for p in (sps, controlled)]
    assert got == want
    assert any(f.endswith("StepBodies.sample") for f in trace.functions()), sorted(trace.functions())
