"""num_scheduler_steps (EngineArgs; CPU graphs, num_spec 0): up to that many decode steps run per
scheduling, a decode graph replayed in a row, each replay writing the next one's inputs itself
(step.metadata.advance_decode, graphs/captured.CapturedSteps.decode, engine/runner._decode_run). What is
generated must not change: tokens, texts and finish reasons equal enforce_eager's one step at a
time, both families, batch 1 and 8, traced graphs and direct calls, with stops inside a run,
prefix-cache hits after a run (the decode snapshot saved where one step at a time saves it),
mixed batches (a sampled row runs one step at a time), a pool too small for a run, a row whose
logits go non-finite inside a run, and several threads. Bad settings are refused before any
weight is read."""

import threading

import pytest
import torch

import mtpkit
from mtpkit import LLM, SamplingParams, StructuredOutputs
from mtpkit.engine.build import check_scheduler_steps
from mtpkit.errors import ConfigError

MODELS = ("tiny-qwen3-next", "tiny-gemma4")
DRAFTERS = {"tiny-qwen3-next": None, "tiny-gemma4": "tiny-gemma4-assistant"}   # None: the MTP head
TEXTS = ["def fibonacci(n):", "The capital of", "import torch\n", "1, 2, 3, 5, 8,", "Once upon",
         "class Node:\n    def", "SELECT * FROM", "# mtpkit"]
BASE = dict(dtype="float64", max_num_seqs=8, max_model_len=128)
_LLMS: dict = {}   # (emptied after the module by conftest._give_back_memory)


def _llm(name: str, steps: int, mode: str = "traced") -> LLM:
    """mode: "eager" (enforce_eager, one step at a time: the oracle), "traced" (graphs traced from
    the first decode step) or "direct" (the bodies called on the static buffers)."""
    key = (name, steps, mode)
    if key not in _LLMS:
        llm = _LLMS[key] = LLM(name, enforce_eager=mode == "eager", num_scheduler_steps=steps, **BASE)
        if mode != "eager":
            llm.runner.graphs.trace_after = 0 if mode == "traced" else 10 ** 9
    return _LLMS[key]


def _runs(monkeypatch, llm: LLM) -> list[int]:
    """The decode_steps of every verify step `llm` runs from now on (in the monkeypatch's scope)."""
    seen, real = [], llm.runner._verify

    def verify(plan):
        seen.append(plan.decode_steps)
        return real(plan)
    monkeypatch.setattr(llm.runner, "_verify", verify)
    return seen


def _outs(outputs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason) for o in outputs for c in o.outputs]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("steps,mode", [(4, "traced"), (3, "direct")])
def test_runs_generate_what_one_step_at_a_time_does(monkeypatch, name, steps, mode):
    eager, llm = _llm(name, 1, "eager"), _llm(name, steps, mode)
    prompts = [llm.tokenizer.encode(t).ids for t in TEXTS]
    base = SamplingParams(max_tokens=30, ignore_eos=True)
    first = eager.generate(prompts[:1], base)[0].outputs[0].token_ids
    # a stop token that ends request 0 inside a run (its 7th token), a stop string, natural EOS,
    # max_tokens that are not multiples of the run
    params = [SamplingParams(max_tokens=30, stop_token_ids=[first[6]], ignore_eos=True),
              SamplingParams(max_tokens=17), SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=23, stop=[llm.tokenizer.decode(first[9:11])]),
              SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=1),
              SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=31, ignore_eos=True)]
    for batch in (1, 8):
        want = _outs(eager.generate(prompts[:batch], params[:batch]))
        with monkeypatch.context() as m:
            seen = _runs(m, llm)
            got = _outs(llm.generate(prompts[:batch], params[:batch]))
        assert got == want, (name, batch)
        assert max(seen) == steps and sum(s > 1 for s in seen) >= 2, seen
    assert got[0][2] == "stop" and got[0][0][-1] == first[6] and len(got[0][0]) <= 7   # stopped inside a run
    if mode == "traced":   # the runs replayed traces (a failed trace turns tracing off)
        assert llm.runner.graphs.decode_graphs and llm.runner.graphs.trace


def test_a_run_emits_tokens_of_their_own_steps(monkeypatch):
    """Each token of a run is a step of its own (no draft positions), and the stats count a
    verify step per token."""
    llm = _llm("tiny-gemma4", 4)
    before = llm.stats.verify_steps
    with monkeypatch.context() as m:
        seen = _runs(m, llm)
        out = llm.generate([llm.tokenizer.encode("The capital of").ids],
                           SamplingParams(max_tokens=21, ignore_eos=True))[0].outputs[0]
    assert 4 in seen and len(seen) < 20
    assert out.token_steps == list(range(21)) and out.token_draft_positions == [0] * 21
    assert llm.stats.verify_steps - before == 20    # the first token is the prefill's
    # a stop inside a run: the steps after it were never steps one at a time
    stop = out.token_ids[6]
    before = llm.stats.verify_steps
    short = llm.generate([llm.tokenizer.encode("The capital of").ids],
                         SamplingParams(max_tokens=21, ignore_eos=True, stop_token_ids=[stop]))[0].outputs[0]
    n = out.token_ids.index(stop) + 1
    assert short.token_ids == out.token_ids[:n] and n % 4 != 1     # (it stopped inside a run)
    assert llm.stats.verify_steps - before == n - 1 and short.token_steps == list(range(n))


def test_prefix_hits_after_a_run_equal_one_step_at_a_time():
    """Qwen3-Next (recurrent state): a run ends at a block boundary at the latest, where the
    decode snapshot is saved as one step at a time saves it, so the next turn resumes from the
    same place (num_cached_tokens) and generates the same tokens."""
    got = {}
    for steps in (1, 4):
        llm = LLM("tiny-qwen3-next", num_scheduler_steps=steps, block_size=4, **BASE)
        llm.runner.graphs.trace_after = 0
        prompt = llm.tokenizer.encode("def fibonacci(n):\n").ids
        sp = SamplingParams(max_tokens=22, ignore_eos=True)
        first = llm.generate([prompt], sp)[0].outputs[0].token_ids
        second = llm.generate([prompt + first + prompt], sp)[0]
        got[steps] = (first, second.outputs[0].token_ids, second.num_cached_tokens)
        llm.close()
    assert got[1] == got[4]
    assert got[4][2] > len(prompt) + 8, "the next turn was meant to hit blocks the first turn's decode keyed"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", ["traced", "direct"])
def test_sampled_rows_draw_in_a_run_what_they_draw_one_step_at_a_time(monkeypatch, name, mode):
    """Random rows without controls or logprobs run too: the run's graph samples each step (the
    sample body: the same p, the same (seed, position) noise) and feeds the drawn token to the
    next, so seeded rows draw what they draw one step at a time, with top-k, top-p and min-p,
    beside greedy rows and an unseeded random row (seeded by the engine and its request id, which
    differ between the two engines: not compared). Hot temperatures: near 1 the trained models
    mostly draw their argmax, which would not tell a wrong draw from a right one."""
    one, llm = _llm(name, 1, "eager"), _llm(name, 4, mode)
    prompts = [llm.tokenizer.encode(t).ids for t in TEXTS[:5]]
    base = dict(max_tokens=22, ignore_eos=True)
    params = [SamplingParams(**base, temperature=1.8, seed=11),
              SamplingParams(**base, temperature=2.0, seed=12, top_k=15),
              SamplingParams(**base, temperature=1.6, seed=13, top_p=0.85, min_p=0.02),
              SamplingParams(**base),
              SamplingParams(**base, temperature=1.7)]              # unseeded: the engine's seed and its id
    for batch in (1, 5):
        want = _outs(one.generate(prompts[:batch], params[:batch]))
        with monkeypatch.context() as m:
            seen = _runs(m, llm)
            got = _outs(llm.generate(prompts[:batch], params[:batch]))
        assert [w for w, p in zip(want, params) if p.seed is not None or p.temperature == 0] == \
            [g for g, p in zip(got, params) if p.seed is not None or p.temperature == 0], (name, batch)
        assert max(seen) == 4, seen
    if mode == "traced":   # the sampled runs replayed traces (a failed trace turns tracing off)
        graphs = llm.runner.graphs
        assert graphs.trace and any(filters is not None for _, _, filters in graphs.decode_graphs)


@pytest.mark.parametrize("name", MODELS)
def test_runs_generate_what_speculative_decoding_generates(name):
    """The project's rule across both levers: decode runs without drafts (greedy and seeded
    sampled rows) generate what num_spec 3 with the family's drafter generates."""
    runs = _llm(name, 4)
    spec = _LLMS.setdefault((name, "spec"), LLM(name, num_spec=3, draft_model=DRAFTERS[name], **BASE))
    prompts = [runs.tokenizer.encode(t).ids for t in TEXTS[:4]]
    base = dict(max_tokens=20, ignore_eos=True)
    params = [SamplingParams(**base), SamplingParams(**base, temperature=1.8, seed=21),
              SamplingParams(**base, temperature=1.6, seed=22, top_k=15, top_p=0.9), SamplingParams(**base)]
    assert _outs(runs.generate(prompts, params)) == _outs(spec.generate(prompts, params))
    assert spec.stats.num_accepted > 0


def test_a_row_with_controls_or_logprobs_runs_one_step_at_a_time(monkeypatch):
    """A step with a row the host must process (penalties, logprobs, a grammar's masks) runs alone;
    once that row finishes the others run in a row again."""
    one, llm = _llm("tiny-qwen3-next", 1), _llm("tiny-qwen3-next", 4)
    prompts = [llm.tokenizer.encode(t).ids for t in TEXTS[:3]]
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.5, seed=7, ignore_eos=True, repetition_penalty=1.2),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.5, seed=8)]
    grammar = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="[a-z]{8}"))
    for controlled in (params[1], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2), grammar):
        params[1] = controlled
        want = _outs(one.generate(prompts, params))
        with monkeypatch.context() as m:
            seen = _runs(m, llm)
            got = _outs(llm.generate(prompts, params))
        assert got == want
        assert seen[:7] == [1] * 7 and max(seen) == 4, seen   # the controlled row's 7 decode steps, then runs
    assert len(got[1][0]) == 8 and all(c.isalpha() and c.islower() for c in got[1][1])   # the grammar held


def test_a_run_the_pool_cannot_hold_steps_one_at_a_time():
    """A run takes blocks for all its steps only when the pools have them all free, else its step
    runs alone as usual, taking nothing more: a run never preempts (a request alone would preempt
    itself over and over) nor holds blocks another request's next step needs. Two requests, one
    block free: a step each fits their last blocks, their runs of 4 would need a block each."""
    kw = dict(BASE, block_size=4, enable_prefix_caching=False)
    prompts = [list(range(5, 10)), list(range(20, 26))]   # next positions 5 and 6: block 1 holds 4..7
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    one = LLM("tiny-qwen3-next", **kw)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, sp)]
    llm = LLM("tiny-qwen3-next", num_scheduler_steps=4, **kw)
    llm.runner.graphs.trace_after = 0
    reqs = [llm.add_request(p, sp) for p in prompts]
    plans, real = [], llm.scheduler.schedule

    def schedule():
        plan = real()
        plans.append(plan)
        return plan
    llm.scheduler.schedule = schedule
    while any(r.num_computed == 0 for r in reqs):   # the prefills
        llm.step()
    assert [r.num_computed for r in reqs] == [5, 6]
    pool = llm.kv_pools["full"]
    held = pool.allocate(pool.num_free - 1)         # one block free
    llm.step()
    assert plans[-1].decode_steps == 1 and pool.num_free == 1   # the run fell back and took nothing
    pool.free(held)
    while llm.scheduler.has_unfinished():
        llm.step()
    assert max(p.decode_steps for p in plans) == 4
    assert [r.output_token_ids for r in reqs] == want and not any(r.num_preemptions for r in reqs)


def test_a_row_whose_logits_go_non_finite_inside_a_run_keeps_the_tokens_before():
    """Row 0's step 2 of a run reports non-finite logits: it ends with an error and the tokens
    before that step (as one step at a time would have emitted), the other rows go on."""
    llm = LLM("tiny-gemma4", num_scheduler_steps=4, **BASE)
    llm.runner.graphs.trace_after = 0
    prompts = [llm.tokenizer.encode(t).ids for t in TEXTS[:2]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    real, runs = llm.runner.graphs.decode, []

    def decode(rows, n, steps, sampled=None):
        out = real(rows, n, steps, sampled)
        runs.append(steps)
        if len(runs) == 2 and steps == 4:
            out[2][0][2] = 0
        return out
    llm.runner.graphs.decode = decode
    got = [o.outputs[0] for o in llm.generate(prompts, sp)]
    assert runs[1] == 4, runs
    assert got[0].finish_reason == "error" and "not finite" in got[0].error
    kept = len(got[0].token_ids)
    assert 1 + 4 + 2 == kept and got[0].token_ids == want[0][:kept]   # prefill's token, a run, 2 steps
    assert got[0].token_steps == list(range(kept)) and got[0].token_draft_positions == [0] * kept
    assert got[1].token_ids == want[1] and got[1].finish_reason == "length"


def test_debug_mode_checks_every_step_of_a_run(monkeypatch):
    """Under mtpkit.debug() each step of a run checks the buffers the decode graph advanced against
    the metadata builder (a wrong advance is caught), and the tokens stay the same."""
    llm = _llm("tiny-qwen3-next", 3, "direct")
    prompts = [llm.tokenizer.encode(t).ids for t in TEXTS[:3]]   # 3 rows in a graph of 4: a padded row
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    want = _outs(_llm("tiny-qwen3-next", 1, "eager").generate(prompts, sp))
    with mtpkit.debug():
        assert _outs(llm.generate(prompts, sp)) == want
        graphs, real = llm.runner.graphs, llm.runner.graphs._decode_fn

        def not_advancing_seq_lens(max_seq_len, filters=None):   # a planted fault
            decode = real(max_seq_len, filters)

            def run(*args):
                out = decode(*args)
                args[3].sub_(1)
                return out
            return run
        monkeypatch.setattr(graphs, "_decode_fn", not_advancing_seq_lens)
        with pytest.raises(AssertionError, match="seq_lens"):
            llm.generate(prompts, sp)


def test_callers_on_threads_get_what_they_get_alone():
    """Eight callers on one engine with runs, half sampling (seeded): the steps batch them together
    and each gets what one step at a time gives it alone."""
    llm = _llm("tiny-gemma4", 4)
    prompts = [llm.tokenizer.encode(t).ids for t in TEXTS]
    sp = [SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True,   # half of the callers sample (seeded)
                         **(dict(temperature=1.7, seed=30 + i) if i % 2 else {})) for i in range(len(prompts))]
    one = _llm("tiny-gemma4", 1)
    want = [_outs(one.generate([p], s)) for p, s in zip(prompts, sp)]
    got, errors = [None] * len(prompts), []

    def call(i):
        try:
            got[i] = _outs(llm.generate([prompts[i]], sp[i]))
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)   # (a deadlock fails here instead of hanging the run)
    assert not any(t.is_alive() for t in threads) and not errors and got == want


def test_a_stream_reports_a_run_at_once():
    llm = _llm("tiny-qwen3-next", 4)
    prompt = llm.tokenizer.encode("Once upon").ids
    sp = SamplingParams(max_tokens=25, ignore_eos=True)
    events = list(llm.stream(prompt, sp))
    assert "".join(e.delta for e in events) == events[-1].output.outputs[0].text
    assert len(events[-1].output.outputs[0].token_ids) == 25 and len(events) < 15


@pytest.mark.parametrize("kw,problem", [
    (dict(num_scheduler_steps=0), "must be >= 1"),
    (dict(num_scheduler_steps=2.0), "must be an int"),
    (dict(num_scheduler_steps=None), "must be an int"),
    (dict(num_scheduler_steps=4, num_spec=3), "set num_scheduler_steps=1 or num_spec=0"),
    (dict(num_scheduler_steps=4, enforce_eager=True), "enforce_eager=True has none"),
])
def test_bad_settings_are_refused_before_any_weight_is_read(kw, problem):
    with pytest.raises(ConfigError, match=problem):
        LLM("tiny-qwen3-next", **kw)


def test_cuda_and_tensor_parallelism_are_refused():
    check_scheduler_steps(4, torch.device("cpu"), 1)
    with pytest.raises(ConfigError, match="CPU-only"):
        check_scheduler_steps(4, torch.device("cuda"), 1)
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        check_scheduler_steps(4, torch.device("cpu"), 2)
    check_scheduler_steps(1, torch.device("cuda"), 2)


def _advance_case(g, n: int, R: int, pools: int, bs: int, max_blocks: int):
    """Real rows 0..R-1 at random positions (some at a block's last slot, one whose next position
    is past its table: a run's last step) with random blocks, padded rows after (inert)."""
    from mtpkit.step.metadata import UniformRow, padded_row
    rows = []
    for i in range(R):
        start = int(torch.randint(0, max_blocks * bs - 1, (1,), generator=g))
        if i == 0:
            start = max_blocks * bs - 1                        # its next position has no block
        elif i == 1:
            start = bs * 2 - 1                                 # the next position starts a block
        held = start // bs + 1 + (i % 2 and start // bs + 1 < max_blocks)
        ids = [[int(b) for b in torch.randint(1, 50, (held,), generator=g)] for _ in range(pools)]
        rows.append(UniformRow([int(torch.randint(0, 100, (1,), generator=g))], start, ids, [i + 1], 1))
    return rows + [padded_row(1, 1, pools)] * (n - R)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.jit.trace's, as graphs/captured.py hides it
@pytest.mark.parametrize("mode", ["eager", "traced", "aot"])
def test_the_decode_advance_is_the_next_steps_metadata(tmp_path, mode):
    """step.metadata.advance_decode (what the decode graph runs after the verify body) leaves in
    the buffers what build_uniform gives for the rows one token further (the greedy tokens, each
    row's next position, sequence length and slots from its blocks; padded rows in the null block),
    keeps the outcome at history[step] and counts the step; traced, and compiled for real by
    AOTInductor as LLM(compile="aot") compiles the decode graph (seconds: this part alone)."""
    from mtpkit.graphs.compiled import Compiler
    from mtpkit.step.metadata import UniformRow, advance_decode, build_uniform
    n, R, pools, bs, max_blocks, steps = 6, 4, 2, 4, 5, 3
    g = torch.Generator().manual_seed(11)

    def fn(greedy, token_ids, positions, slot_mappings, seq_lens, block_tables, history, step):
        advance_decode(greedy, token_ids, positions, slot_mappings, seq_lens, block_tables, history, step, bs)
        return token_ids + 0   # (a graph returns something)

    def buffers(rows, step: int = 0, backing: list | None = None):
        """build_uniform's values in views of graph size n over buffers of n + 2 rows (as
        StaticBuffers passes them: the slots', tables' and history's strided), the rows past n
        a sentinel the advance must not touch; then the history and the step counter."""
        tok, pos, meta = build_uniform(rows, n, bs, max_blocks, "cpu")
        views = []
        for t, dim in ((tok, 0), (pos, 0), (meta.slot_mappings, 1), (meta.seq_lens, 0), (meta.block_tables, 1),
                       (torch.zeros(steps, n, 3, dtype=torch.int64), 1)):
            shape = list(t.shape)
            shape[dim] += 2
            big = torch.full(shape, -7, dtype=torch.int64)
            view = big[:n] if dim == 0 else big[:, :n]
            view.copy_(t)
            views.append(view)
            if backing is not None:
                backing.append((big, dim))
        return views + [torch.tensor([step])]

    rows = _advance_case(g, n, R, pools, bs, max_blocks)
    greedy = torch.stack([torch.randint(0, 100, (n,), generator=g), torch.ones(n, dtype=torch.int64),
                          torch.ones(n, dtype=torch.int64)], dim=1)
    example = buffers(rows[:R], 1)
    run = {"eager": lambda: fn, "traced": lambda: torch.jit.trace(fn, (greedy, *example), check_trace=False),
           "aot": lambda: Compiler("aot", [torch.nn.Linear(1, 1)], cache_dir=tmp_path).compile(
               fn, (greedy, *example), "advance_test")}[mode]()
    for trial in range(3):
        rows = _advance_case(g, n, R, pools, bs, max_blocks)
        greedy[:, 0] = torch.randint(0, 100, (n,), generator=g)
        backing = []
        bufs = buffers(rows[:R], trial, backing)
        run(greedy, *bufs)
        for big, dim in backing:   # nothing written past graph size n
            assert (big[n:] if dim == 0 else big[:, n:]).eq(-7).all()
        nxt = [UniformRow([int(t)], r.start + 1, r.block_ids, r.state_slots, 1)
               for t, r in zip(greedy[:R, 0].tolist(), rows[:R])]
        want = buffers(nxt[1:])[:5]                            # row 0's next position has no block
        got = [b[..., 1:R] if b.dim() < 3 else b[:, 1:R] for b in bufs[:5]]
        want = [w[..., :R - 1] if w.dim() < 3 else w[:, :R - 1] for w in want]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (trial, got, want)
        assert bufs[0][0] == greedy[0, 0] and bufs[1][0] == rows[0].start + 1
        last = [rows[0].block_ids[p][-1] for p in range(pools)]   # clamped to the table's last column
        assert bufs[2][:, 0].tolist() == [b * bs + (rows[0].start + 1) % bs for b in last]
        # padded rows: one position further, still in the null block
        assert bufs[1][R:].tolist() == [1] * (n - R) and bufs[2][:, R:].tolist() == [[1] * (n - R)] * pools
        assert torch.equal(bufs[5][trial], greedy) and not bufs[5][trial + 1:].any() and int(bufs[6]) == trial + 1
