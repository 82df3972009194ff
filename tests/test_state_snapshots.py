"""Recurrent-state snapshots inside a prefill chunk (docs/design.md, "State snapshots").

Kernel level (torch reference, fp64): the GDN state and the conv state a prefill writes for a
snapshot after token p equal the recurrence run over the tokens up to p only (the GDN's token
by token), at positions inside a 64-token chunk, at chunk boundaries and at the chunk's last
token, for one request and for several (the padded path), with and without initial state.
(The Triton kernels against this reference: tests/test_triton_kernels.py.)

Engine level (random fp64 Qwen3-Next with an MTP head): a prompt prefilled with snapshots at
block boundaries (in one chunk, and over chunks cut at other boundaries); each snapshot
restored into a fresh request's slots (poisoned with NaN first), which prefills only the rest
of the prompt: its next-token logits equal the full prefill's (1e-10) and its greedy
continuation is the full prefill's, with num_spec 0 and 3. Snapshots saved after verify
steps (the accepted positions' slots) resume the same way.
"""

import oracle
import pytest
import spec_models
import torch

from mtpkit import LLM, SamplingParams
from mtpkit.engine.request import Status
from mtpkit.engine.scheduler import StepKind
from mtpkit.kernels import conv, gdn
from mtpkit.step.cache import allocate_snapshots
from mtpkit.step.metadata import StateSnapshots
from mtpkit.shapes import is_debug

F64 = {"dtype": "float64", "device": "cpu"}


# ---- kernels ---------------------------------------------------------------------------

def _snapshots(rows, tokens, ids):
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    return StateSnapshots(rows=t(rows), token_index=t(tokens), ids=t(ids))


def _gdn_inputs(g, T, hk=2, hv=4, dk=8, dv=8):
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return (r(T, hk, dk), r(T, hk, dk), r(T, hv, dv), r(T, hv), r(T, hv),
            torch.log(torch.rand(hv, generator=g, dtype=torch.float64) * 4 + 0.5), r(hv))


@pytest.mark.parametrize("lens", [[150], [150, 130], [7, 140]])
def test_gdn_prefill_snapshot_equals_recurrence_up_to_p(lens):
    """Snapshots at positions in and at the end of 64-token chunks, the last token, the first."""
    g = torch.Generator().manual_seed(sum(lens))
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(g, sum(lens))
    hv, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    pool = torch.randn(6, hv, dk, dv, generator=g, dtype=torch.float64)
    qsl = torch.tensor([0] + lens).cumsum(0)
    has_init = torch.tensor([i == 0 for i in range(len(lens))])    # the first request resumes
    wanted = [(i, p) for i, n in enumerate(lens) for p in (0, 15, 47, 63, 64, 111, 127, n - 1) if p < n]
    wanted = list(dict.fromkeys(wanted))
    snaps = _snapshots([i for i, _ in wanted], [int(qsl[i]) + p for i, p in wanted], range(len(wanted)))
    store = torch.full((len(wanted) + 2, hv, dk, dv), float("nan"), dtype=torch.float64)
    slots = torch.arange(1, len(lens) + 1)
    init = pool[slots].clone()
    gdn.gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, pool, qsl, slots, slots, has_init,
                                 snapshots=snaps, snapshot_state=store)
    qp, kp, gg, beta = gdn.gdn_prepare(q, k, a, b, A_log, dt_bias, dtype=torch.float64)
    for sid, (i, p) in enumerate(wanted):
        sl = slice(int(qsl[i]), int(qsl[i]) + p + 1)
        s0 = init[i] if has_init[i] else torch.zeros_like(init[i])
        _, expect = gdn.gdn_recurrent_core(qp[sl], kp[sl], v[sl], gg[sl], beta[sl], s0)
        torch.testing.assert_close(store[sid], expect, rtol=1e-10, atol=1e-10, msg=f"request {i}, position {p}")
    assert torch.isnan(store[len(wanted):]).all()                       # nothing else written


@pytest.mark.parametrize("L", [3, 6])
def test_conv_prefill_snapshot_equals_prefill_up_to_p(L):
    """The conv state of a snapshot after p is what a prefill of the tokens up to p leaves
    (W-1 = 3 window columns, L = 3 or 6 with num_spec 3), near the start too (window columns)."""
    g = torch.Generator().manual_seed(L)
    C, W, lens = 5, 4, [20, 9]
    x = torch.randn(sum(lens), C, generator=g, dtype=torch.float64)
    weight = torch.randn(C, W, generator=g, dtype=torch.float64)
    pool = torch.randn(4, C, L, generator=g, dtype=torch.float64)
    qsl = torch.tensor([0] + lens).cumsum(0)
    has_init = torch.tensor([True, False])
    wanted = [(0, p) for p in (0, 1, 2, 5, 19)] + [(1, p) for p in (0, 3, 8)]
    snaps = _snapshots([i for i, _ in wanted], [int(qsl[i]) + p for i, p in wanted], range(len(wanted)))
    store = torch.full((len(wanted), C, L), float("nan"), dtype=torch.float64)
    before = pool.clone()
    slots = torch.tensor([1, 2])
    conv.causal_conv1d_prefill(x, weight, pool, qsl, slots, has_init, snapshots=snaps, snapshot_state=store)
    for sid, (i, p) in enumerate(wanted):
        ref_pool = before.clone()
        sl = slice(int(qsl[i]), int(qsl[i]) + p + 1)
        conv.causal_conv1d_prefill(x[sl], weight, ref_pool, torch.tensor([0, p + 1]), slots[i:i + 1],
                                   has_init[i:i + 1])
        torch.testing.assert_close(store[sid], ref_pool[slots[i]], rtol=0, atol=0, msg=f"request {i}, position {p}")


# ---- the engine ----------------------------------------------------------------------------

BLOCK = 16
PROMPT_LEN = 150


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dict(oracle.TINY_CONFIGS["base"])        # [L, L, L, F]: three GDN layers
    return spec_models.build_spec_checkpoint(tmp_path_factory.mktemp("snap") / "ck", cfg, 3, "bigram", 0.2)


@pytest.fixture(scope="module")
def prompt():
    return oracle.random_prompts(1, 256, seed=11, lengths=[PROMPT_LEN])[0]


class Hooks:
    """The prefix cache's part, by hand: which prefill chunks write which snapshots, where a
    request's chunks end, and which snapshot a request resumes from (its slots poisoned
    first, so a missed copy shows). Records the logits of each request's first token."""

    def __init__(self, llm):
        self.llm, self.sched = llm, llm.scheduler
        self._schedule, self._chunk, self._update = self.sched.schedule, self.sched._chunk, self.sched.update
        self.sched.schedule, self.sched._chunk, self.sched.update = self.schedule, self.chunk, self.update
        self.snap_at: dict = {}      # request -> {tokens consumed: snapshot id}
        self.cuts: dict = {}         # request -> token counts its prefill chunks end at
        self.resume: dict = {}       # request -> (tokens, snapshot id)
        self.verify_snaps: dict = {}  # request -> ids to save after verify steps (tokens -> id filled in)
        self.first_logits: dict = {}
        self._watch = None
        model = llm.model
        self._compute = model.compute_logits

        def compute_logits(hidden):
            out = self._compute(hidden)
            if self._watch is not None:
                self.first_logits[self._watch], self._watch = out[0].clone(), None
            return out
        model.compute_logits = compute_logits

    def close(self):
        self.sched.schedule, self.sched._chunk, self.sched.update = self._schedule, self._chunk, self._update
        del self.llm.model.compute_logits

    def chunk(self, r, budget):
        n = self._chunk(r, budget)
        cut = next((c for c in sorted(self.cuts.get(r.req_id, ())) if c > r.num_computed), None)
        return n if cut is None else min(n, cut - r.num_computed)

    def schedule(self):
        plan = self._schedule()
        if plan is not None and plan.kind == StepKind.PREFILL:
            cache = self.llm.cache
            for row, (r, n) in enumerate(zip(plan.reqs, plan.chunk_lens)):
                s = r.num_computed
                for tokens, sid in self.snap_at.get(r.req_id, {}).items():
                    if s < tokens <= s + n:
                        plan.snapshots.append((row, tokens - s - 1, sid))
                if r.req_id in self.resume and self.resume[r.req_id][0] == s:
                    for layers in cache.state.values():
                        for layer in layers:
                            for t in layer.values():
                                t[r.state_slots] = float("nan")
                    cache.restore_snapshots([self.resume[r.req_id][1]], [r.state_slots])
                if s + n == r.prefill_target and not r.output_token_ids:
                    self._watch = r.req_id
        return plan

    def update(self, plan, results):
        before = {r.req_id: r.num_computed for r in plan.reqs}
        out = self._update(plan, results)
        if plan.kind == StepKind.VERIFY:
            for r in plan.reqs:
                free = self.verify_snaps.get(r.req_id)
                if free is None or r.status == Status.FINISHED:
                    continue
                free["accepted"].append(r.prev_num_emitted)
                # The accepted positions 0..a-1: the state after position t holds tokens
                # before + t + 1 of the sequence.
                for t in range(r.prev_num_emitted):
                    if free["ids"]:
                        sid = free["ids"].pop()
                        self.llm.cache.save_verify_snapshots([r.state_slots], [t], [sid])
                        free["saved"][before[r.req_id] + t + 1] = sid
        return out


def _llm(checkpoint, num_spec):
    """num_spec 3: decode steps captured (CPU traces from the first replay), the store beside
    them; num_spec 0 eager (tracing costs test time)."""
    llm = LLM(checkpoint, num_spec=num_spec, max_model_len=256, block_size=BLOCK, enforce_eager=num_spec == 0,
              **F64)
    if llm.runner.graphs is not None:
        llm.runner.graphs.trace_after = 0
    spec = type(llm.model).cache_spec(llm.model_config, num_spec=num_spec)
    llm.cache.snapshots = allocate_snapshots(spec, 16, torch.float64, torch.device("cpu"))
    return llm


@pytest.fixture(scope="module")
def llms(checkpoint):
    return {}


@pytest.fixture(params=[0, 3], ids=["num_spec0", "num_spec3"])
def llm(request, checkpoint, llms):
    if request.param not in llms:
        llms[request.param] = _llm(checkpoint, request.param)
    return llms[request.param]


SP = SamplingParams(max_tokens=12, ignore_eos=True)


def _reference(llm, hooks, prompt):
    r = llm.add_request(prompt, SP)
    while r.status != Status.FINISHED:
        llm.step()
    return r.output_token_ids, hooks.first_logits[r.req_id]


def _resume(llm, hooks, prompt, tokens, sid):
    """A fresh request of `prompt` whose state at `tokens` is snapshot sid: it computes the
    KV of the first `tokens` itself (the prefix cache would share those blocks), then its
    state is replaced and it prefills the rest."""
    r = llm.add_request(prompt, SP)
    hooks.cuts[r.req_id], hooks.resume[r.req_id] = [tokens], (tokens, sid)
    while r.status != Status.FINISHED:
        llm.step()
    return r.output_token_ids, hooks.first_logits[r.req_id]


@pytest.mark.parametrize("cuts", [[], [40, 96]], ids=["one_chunk", "chunked"])
def test_resume_from_prefill_snapshots(llm, prompt, cuts):
    """Snapshots at 16 (mid 64-chunk), 48, 64 (a 64-chunk's end), 96 (a prefill chunk's last
    token when chunked), 112 and 144; one chunk or chunks cut at 40 and 96."""
    hooks = Hooks(llm)
    try:
        ref_tokens, ref_logits = _reference(llm, hooks, prompt)
        points = [16, 48, 64, 96, 112, 144]
        a = llm.add_request(prompt, SP)
        hooks.cuts[a.req_id], hooks.snap_at[a.req_id] = cuts, {p: i for i, p in enumerate(points)}
        while a.status != Status.FINISHED:
            llm.step()
        assert a.output_token_ids == ref_tokens          # writing snapshots changes nothing
        for sid, tokens in enumerate(points):
            out, logits = _resume(llm, hooks, prompt, tokens, sid)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10, msg=f"snapshot at {tokens}")
            assert out == ref_tokens, f"snapshot at {tokens}"
    finally:
        hooks.close()


@pytest.mark.parametrize("llm", [3], indirect=True, ids=["num_spec3"])
def test_resume_from_verify_snapshots(llm, prompt):
    """num_spec 3: after each verify step the state after every accepted position is saved
    (save_verify_snapshots); a request of the sequence up to such a position + 1 more token
    resumes from it and continues as the sequence did."""
    hooks = Hooks(llm)
    try:
        short = prompt[:40]
        a = llm.add_request(short, SP)
        hooks.verify_snaps[a.req_id] = {"ids": list(range(16)), "saved": {}, "accepted": []}
        while a.status != Status.FINISHED:
            llm.step()
        seq = short + a.output_token_ids
        saved = hooks.verify_snaps[a.req_id]["saved"]
        accepted = hooks.verify_snaps[a.req_id]["accepted"]
        assert len(saved) >= 4 and max(accepted) > 1 and min(accepted) < 4   # drafts accepted, some rejected
        for tokens, sid in sorted(saved.items())[:6]:
            if tokens + 1 >= len(seq):
                continue
            p = seq[:tokens + 1]
            ref_out, ref_logits = _reference(llm, hooks, p)
            out, logits = _resume(llm, hooks, p, tokens, sid)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10, msg=f"verify snapshot at {tokens}")
            assert out == ref_out, f"verify snapshot at {tokens}"
            n = min(len(out), len(seq) - len(p))
            assert out[:n] == seq[len(p):len(p) + n], f"verify snapshot at {tokens}"
    finally:
        hooks.close()


@pytest.mark.parametrize("llm", [3], indirect=True, ids=["num_spec3"])
def test_snapshot_store_bytes(llm):
    """A snapshot is one slot's bytes (every GDN layer's conv + ssm); the decode steps ran
    captured (traced) with the store allocated and snapshots written between them."""
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))
    graphs = llm.runner.graphs
    # traced, no fallback (debug mode calls the graph bodies directly, to check every shape)
    assert graphs is not None and graphs.trace and (bool(graphs.verify_graphs) != is_debug())
    spec = type(llm.model).cache_spec(llm.model_config, num_spec=3)
    assert llm.cache.bytes_per_snapshot == spec.bytes_per_slot(torch.float64)
    cfg = llm.model_config
    conv_cols = cfg.linear_conv_kernel_dim - 1 + 3
    one = cfg.conv_dim * conv_cols + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    assert llm.cache.bytes_per_snapshot == len(cfg.linear_layers) * one * 8
    assert llm.cache.num_snapshots == 16


def test_verify_snapshots_of_several_requests_in_one_call():
    """save_verify_snapshots with several requests at once (one prefix-cache step may save for
    many): each snapshot is its own request's state after its own position, the conv columns
    shifted to where a prefill leaves them (left zero-filled), stated here by plain indexing."""
    from mtpkit.step.cache import CacheTensors
    torch.manual_seed(0)
    num_spec, C, W = 3, 5, 4
    L = W - 1 + num_spec
    state = {"gdn": [{"conv": torch.randn(9, C, L), "ssm": torch.randn(9, 2, 3, 3)} for _ in range(2)]}
    snaps = {"gdn": [{"conv": torch.full((4, C, L), 7.0), "ssm": torch.full((4, 2, 3, 3), 7.0)} for _ in range(2)]}
    cache = CacheTensors({}, state, 16, {}, (), snaps)
    slots, positions, ids = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]], [0, 3, 2], [2, 0, 3]
    cache.save_verify_snapshots(slots, positions, ids)
    for layer, snap in zip(state["gdn"], snaps["gdn"]):
        for sl, t, sid in zip(slots, positions, ids):
            assert torch.equal(snap["ssm"][sid], layer["ssm"][sl[t]])
            shift = num_spec - t
            want = torch.zeros(C, L)
            want[:, shift:] = layer["conv"][sl[0]][:, :L - shift]
            assert torch.equal(snap["conv"][sid], want)
        assert (snap["conv"][1] == 7).all() and (snap["ssm"][1] == 7).all()   # id 1: not saved
