"""Runs one scheduled step: metadata -> model -> generation controls -> sampler / rejection -> drafter.

Prefill steps run eager, except on CPU graphs a step of one chunk (state snapshots included), which
replays a traced (or compiled) prefill once its size is used often (CapturedSteps.prefill). A verify
step and the drafter's proposals run the step bodies
(engine/step_bodies.py), written once: called on the step's own tensors under enforce_eager,
otherwise captured and replayed on static buffers by graphs/captured.py (CapturedSteps, handed
the same bodies); padded rows are inert by construction.
Structured outputs' constrained rows draft under their grammar (structured/draft_masks.py):
the masked proposal is eager, run at once in eager mode; with graphs only when the captured
proposal drafted a token a grammar forbids (`_constrained_drafts`).

Under tensor parallelism every rank runs this same code on the same inputs. The sampled tokens,
accepted counts and drafts decide the next step's inputs on every rank (and so what the model's
collectives combine), so rank 0's are broadcast: identical decisions do not rest on every rank's logits being
bit-identical or on every rank's argmax breaking ties alike.
"""

import torch

from mtpkit.step.metadata import PrefillChunk, UniformRow, build_prefill, build_uniform
from mtpkit.config import EngineConfig
from mtpkit.graphs.plan import CapturePlan
from mtpkit.graphs.captured import CapturedSteps
from mtpkit.sampling.controls import ControlTables, controlled_logits, controls_dtype, dead_end_problem
from mtpkit.sampling.logprobs import prompt_logprob_dicts, step_logprobs
from mtpkit.sampling.params import SamplingParams
from mtpkit.sampling.sampler import SamplingTensors
from mtpkit.step.draft import Drafter
from mtpkit.sampling.rejection import rejection_sample
from mtpkit.step.cache import CacheTensors
from mtpkit.engine.scheduler import ReqResult, StepKind, StepPlan
from mtpkit.engine.step_bodies import StepBodies, verify_inputs
from mtpkit.structured.step_masks import StructuredMasks


# Inference mode as torch.inference_mode() sets it, by its guard alone: the decorator builds and
# clones a context object in Python at every step, host work that runs with the caches cold
# after a graph. The public context where torch has no such guard.
_inference_mode = (lambda: torch._C._InferenceMode(True)) if hasattr(torch._C, "_InferenceMode") \
    else torch.inference_mode


class ModelRunner:
    def __init__(self, model, drafter: Drafter | None, cache: CacheTensors, ecfg: EngineConfig,
                 device: torch.device, plan: CapturePlan | None = None):
        """`plan` None: every step eager. Otherwise verify steps replay the captured bodies."""
        self.model, self.drafter, self.cache, self.cfg, self.device = model, drafter, cache, ecfg, device
        self.tp = model.tp
        self._all_greedy: dict[int, SamplingTensors] = {}
        self.bodies = StepBodies(model, drafter, ecfg.bundle)
        self.structured = StructuredMasks(device)   # grammar masks (structured outputs)
        self.control_tables: ControlTables | None = None   # the generation controls' rows, made when first needed
        # An all-greedy verify step without controls takes the verify body's own greedy outcome
        # (one small int tensor) instead of sampling its logits eagerly; False: always eager
        # (tests compare the two).
        self.greedy_in_step = True
        # With graphs, a step with random rows (and no grammar or multi-token bad word) samples in
        # the sample graph (CapturedSteps.sample); False: eagerly (tests compare the two).
        self.sample_in_step = True
        self.graphs: CapturedSteps | None = None
        if plan is not None:
            self.graphs = CapturedSteps(self.bodies, cache, ecfg, plan, device)
            self.graphs.capture()

    def _sampling(self, params: list[SamplingParams]) -> SamplingTensors:
        """The step's sampling tensors. An all-greedy batch's depend only on its size (top-k
        and top-p do not apply to greedy rows): built once per size and reused (nothing
        writes to them)."""
        if any(p.temperature != 0 for p in params):
            return SamplingTensors.from_params(params, self.device)
        n = len(params)
        if n not in self._all_greedy:
            self._all_greedy[n] = SamplingTensors.from_params([SamplingParams()] * n, self.device)
        return self._all_greedy[n]

    def execute(self, plan: StepPlan) -> list[ReqResult]:
        with _inference_mode():
            if plan.copies:   # copy-on-write blocks and forked samples' state, before anything writes
                self.cache.apply(plan.copies)
            if plan.kind == StepKind.PREFILL:
                return self._prefill(plan)
            return self._verify(plan)

    # ---- generation controls ------------------------------------------------------------
    def _tables(self, logits) -> ControlTables:
        """The controls' tables: one row per running request, made at the first step that needs them."""
        if self.control_tables is None:
            self.control_tables = ControlTables(self.cfg.max_num_seqs + 1, logits.shape[-1],
                                                controls_dtype(logits.dtype), self.device)
        return self.control_tables

    def _controls(self, logits, drafts, reqs, captured: bool):
        """The generation controls (sampling/controls.py) on a step's logits: the same tensor
        when no row uses one. `captured`: a verify step whose graph-safe part replays on the
        graphs' static buffers (CapturedSteps.controls), else it runs here on these tensors."""
        apply = None
        if captured:
            R = logits.shape[0]

            def apply(inputs):
                processed = self.graphs.controls(inputs, self.control_tables.tensors())
                return processed if processed.shape[0] == R else processed[:R]
        return controlled_logits(logits, drafts, reqs, lambda: self._tables(logits), apply)

    @staticmethod
    def _live(logits, processed, controlled: bool):
        """[R, B] 1 where the processed logits leave some token to generate (all 1 when no control
        or grammar touched them: the raw logits' own check covers those rows)."""
        if not controlled:
            return torch.ones(logits.shape[:2], dtype=torch.int64, device=logits.device)
        return torch.isfinite(processed.amax(-1)).long()

    # ---- prefill ----------------------------------------------------------------------
    def prefill_hidden(self, chunks: list[PrefillChunk], snapshots: list[tuple[int, int, int]] = ()):
        token_ids, positions, meta = build_prefill(chunks, self.cfg.block_size, self.cfg.max_blocks, self.device,
                                                   snapshots)
        return self.model(token_ids, positions, meta, self.cache), positions, meta

    def _prefill(self, plan: StepPlan) -> list[ReqResult]:
        reqs = plan.reqs
        chunks = [PrefillChunk(r.all_token_ids[r.num_computed:r.num_computed + n], r.num_computed,
                               [t.ids for t in r.block_tables], r.state_slots)
                  for r, n in zip(reqs, plan.chunk_lens)]
        token_ids, positions, meta = build_prefill(chunks, self.cfg.block_size, self.cfg.max_blocks, self.device,
                                                   plan.snapshots)
        # CPU graphs: a one-chunk step replays a traced / compiled prefill once its size is used often
        # (CapturedSteps.prefill; None: eager, as every other prefill runs).
        hidden = None if self.graphs is None else self.graphs.prefill(token_ids, positions, meta, chunks[0].start)
        if hidden is None:
            hidden = self.model(token_ids, positions, meta, self.cache)
        finishing = [i for i, (r, n) in enumerate(zip(reqs, plan.chunk_lens)) if r.num_computed + n == r.prefill_target]
        results = [ReqResult([], 1, 0, []) for _ in reqs]
        self._prompt_logprobs(plan, hidden, results)
        if not finishing:
            sampled = []
        else:
            last = meta.logits_indices[finishing]
            logits = self.model.compute_logits(hidden[last])[:, None, :]            # [finishing, 1, vocab]
            finishing_reqs = [reqs[i] for i in finishing]
            sampling = self._sampling([r.params for r in finishing_reqs])
            empty = torch.zeros(len(finishing), 0, dtype=torch.int64, device=self.device)
            processed = self._controls(logits, empty, finishing_reqs, captured=False)   # generation controls
            masks = self.structured.prefill(finishing_reqs)     # structured outputs: the first token's mask
            controlled = processed is not logits or masks is not None
            if masks is not None:
                processed = masks.apply(processed, finishing_reqs, keep_raw=processed is logits)
            tokens, _ = rejection_sample(processed, empty, torch.zeros(len(finishing), dtype=torch.int64,
                                                                    device=self.device),
                                         sampling, [r.seed for r in finishing_reqs], [r.prefill_target for r in finishing_reqs])
            bad = (~torch.isfinite(logits.amax(-1)[:, 0])).long()
            live = self._live(logits, processed, controlled)[:, 0]
            out = self.tp.broadcast(torch.stack([tokens[:, 0], bad, live], dim=1).contiguous()).tolist()
            sampled = [t for t, _, _ in out]
            ask = [a for a, r in enumerate(finishing_reqs) if r.params.logprobs is not None]
            if ask:
                raw = logits if masks is None else masks.raw_logits(logits)
                per_row = step_logprobs(raw[ask], processed[ask], torch.tensor([[sampled[a]] for a in ask], device=self.device),
                                        [finishing_reqs[a].params for a in ask], [1] * len(ask))
                for a, lps in zip(ask, per_row):
                    results[finishing[a]].logprobs = lps
            for i, (token, nonfinite, alive) in zip(finishing, out):
                results[i].emitted = [token]
                r = reqs[i]
                if nonfinite:
                    results[i].error = non_finite(r, "the prefill", r.prefill_target - 1)
                elif not alive:
                    results[i].error = no_token_left(r, r.prefill_target)
            for a, msg in ({} if masks is None else masks.errors).items():
                results[finishing[a]].error = msg
        if self.drafter is not None:
            # The token after each position: the next prompt token, or for a finished prompt
            # the token just sampled (a non-final chunk's last position sees the next chunk's first).
            following = []
            sampled_of = dict(zip(finishing, sampled))
            for i, (r, n) in enumerate(zip(reqs, plan.chunk_lens)):
                seq = r.all_token_ids
                follow = seq[r.num_computed + 1:r.num_computed + n]
                follow.append(sampled_of[i] if i in sampled_of else seq[r.num_computed + n])
                following.extend(follow)
            # The draft rows: the prompts that finished (their last tokens, their block tables).
            rows = finishing or [0]   # observe: no row samples, the drafter only reads the step
            step = (hidden, token_ids, torch.tensor(following, dtype=torch.int64, device=self.device), positions,
                    meta.slot_mappings, meta.logits_indices[rows], meta.block_tables[:, rows])
            if finishing:
                draft_masks = self._draft_masks(finishing_reqs, masks, [[t] for t in sampled])
                try:
                    drafts = self._prefill_drafts(meta, step, draft_masks)
                finally:
                    if draft_masks is not None:
                        draft_masks.close()
                drafts = self.tp.broadcast(drafts.contiguous())
                for i, d in zip(finishing, drafts.tolist()):
                    results[i].drafts = d
            else:
                self.bodies.observe(meta.max_seq_len, *step, self.cache, meta)
        return results

    def _prompt_logprobs(self, plan: StepPlan, hidden, results: list[ReqResult]) -> None:
        """Raw logprobs of the prompt tokens this step's chunks reach (position p's logits give
        token p + 1's), for the requests that ask and only those not already known (a
        recompute after preemption prefills them again): one compute_logits for the step."""
        rows, next_tokens, tops, owners, start = [], [], [], [], 0
        for i, (r, n) in enumerate(zip(plan.reqs, plan.chunk_lens)):
            if r.prompt_logprobs is not None:
                prompt = r.prompt_token_ids
                first = max(r.num_computed, len(r.prompt_logprobs) - 1)
                last = min(r.num_computed + n, len(prompt) - 1)      # positions first..last-1
                for p in range(first, last):
                    rows.append(start + p - r.num_computed)
                    next_tokens.append(prompt[p + 1])
                    tops.append(r.params.prompt_logprobs)
                    owners.append(i)
            start += n
        if not rows:
            return
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        dicts = prompt_logprob_dicts(logits, torch.tensor(next_tokens, dtype=torch.int64, device=self.device), tops)
        for i, d in zip(owners, dicts):
            if results[i].prompt_logprobs is None:
                results[i].prompt_logprobs = []
            results[i].prompt_logprobs.append(d)

    def _prefill_drafts(self, meta, step: tuple, draft_masks=None):
        """The proposal after a prefill: the body, through CapturedSteps when there are graphs."""
        if self.graphs is None:
            return self.bodies.prefill_proposal(meta.max_seq_len, *step, self.cache, meta, draft_masks)
        return self.graphs.prefill_proposal(meta.max_seq_len, *step, meta, draft_masks)

    def _draft_masks(self, reqs: list, masks, emitted: list[list[int]]):
        """Constrained drafting: the drafter's per-pass grammar masks for the step's constrained
        rows after what they emitted (None without any: the proposal stays captured)."""
        return None if masks is None else self.structured.proposal(reqs, emitted, masks.errors)

    def _constrained_drafts(self, propose, draft_masks) -> list[list[int]]:
        """A verify step's drafts, `propose(draft_masks)` -> drafts per row. With constrained
        rows and graphs, the captured proposal runs first and the masked one (eager) only if it
        drafted a token a grammar forbids (otherwise the masked one would draft the same);
        eager steps run the masked one at once."""
        if draft_masks is None:
            return propose(None)
        drafts = None if self.graphs is None else propose(None)
        if drafts is not None and draft_masks.allows_all(drafts):
            return drafts
        self.structured.masked_proposals += 1
        try:
            return propose(draft_masks)
        finally:
            draft_masks.close()

    # ---- verify -----------------------------------------------------------------------
    @staticmethod
    def _dead_ends(live: list[list[int]], emitted: list[int]) -> dict[int, int]:
        """Row -> the first bundle position j the row reached (every draft before it accepted)
        where nothing may be generated, cutting emitted[row] to j in place. Without drafts the
        request would emit the same j tokens and fail at the next step, so it keeps them and
        ends there. A dead position after a rejected draft is never reached: nothing happens."""
        dead = {}
        for i, row in enumerate(live):
            j = next((j for j in range(emitted[i]) if not row[j]), None)
            if j is not None:
                dead[i], emitted[i] = j, j
        return dead

    def _decode_run(self, plan: StepPlan) -> list[ReqResult]:
        """plan.decode_steps decode steps in a row (num_scheduler_steps; no drafts, every row
        Request.plain, CPU graphs: the scheduler and the engine's build see to it), each step's
        tokens the next one's inputs: greedy, or with a random row sampled inside the run's graph
        (always: ModelRunner.sample_in_step applies to single steps). A row whose logits were not
        finite at step j keeps the j tokens before it and ends, as it would have one step at a time."""
        reqs, steps = plan.reqs, plan.decode_steps
        rows = [UniformRow([r.last_token_id], r.num_computed, [t.ids for t in r.block_tables], r.state_slots,
                           r.prev_num_emitted) for r in reqs]
        sampled = any(r.params.temperature > 0 for r in reqs)
        outcomes = self.graphs.decode(rows, plan.num_reqs_padded, steps, reqs if sampled else None)
        results = []
        for i, r in enumerate(reqs):
            res = ReqResult([o[i][0] for o in outcomes], steps, 0, [])
            bad = next((j for j, o in enumerate(outcomes) if not o[i][2]), None)
            if bad is not None:
                res.error = non_finite(r, f"decode step {r.num_steps + bad}", r.num_computed + bad)
                res.tokens_before_error = bad
            results.append(res)
        return results

    def _verify(self, plan: StepPlan) -> list[ReqResult]:
        if plan.decode_steps > 1:
            return self._decode_run(plan)
        reqs, R, B, k = plan.reqs, plan.num_reqs, plan.bundle, plan.bundle - 1
        n = plan.num_reqs_padded
        limit_list = [min(k, max(r.remaining(self.cfg.max_model_len) - 1, 0)) for r in reqs]
        # Structured outputs: the drafts checked against the grammar on the host before the step
        # (constrained drafting may rewrite them; limits capped at a forbidden draft), then bundle
        # position j's mask (the grammar after drafts 0..j-1) filled by a worker during the forward.
        pending = self.structured.verify(reqs, limit_list, B)
        # Every row greedy without controls, logprobs or a grammar: the verify body's greedy
        # outcome is the step's, and no tensor op runs on the host besides reading it back (each
        # op after a graph costs ~10 us: the graph's weights have evicted the host's code and data).
        plain = pending is None and self.greedy_in_step and all(r.plain_greedy for r in reqs)
        all_greedy = plain or all(r.params.temperature == 0 for r in reqs)
        uses_controls = not plain and any(r.params.has_controls for r in reqs)
        ask = [] if plain else [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        # The step's outcome from a graph (sampling/rejection: tokens, num_emitted, finite, live) where
        # the logits it reads are the step's last (no grammar; no multi-token bad word, banned on the
        # host after the controls): an all-greedy step's whose logits the controls processed, from the
        # controls graph; a step with random rows, from the sample graph (CapturedSteps.sample).
        from_graph = (not plain and pending is None and self.graphs is not None
                      and not any(r.controls is not None and r.controls.multi_words for r in reqs)
                      and ((all_greedy and uses_controls and self.greedy_in_step)
                           or (not all_greedy and self.sample_in_step)))
        rows = [UniformRow([r.last_token_id] + r.drafts, r.num_computed, [t.ids for t in r.block_tables],
                           r.state_slots, r.prev_num_emitted) for r in reqs]
        meta = processed = masks = None
        try:
            if self.graphs is not None:
                hidden, logits, greedy, positions, token_ids, limit = self.graphs.verify(rows, n, limit_list)
            else:  # the body CapturedSteps captures, on this step's own tensors
                token_ids, positions, meta = build_uniform(rows, n, self.cfg.block_size, self.cfg.max_blocks,
                                                           self.device)
                limit = torch.tensor(limit_list, dtype=torch.int64, device=self.device)
                step = verify_inputs(token_ids, positions, meta)
                hidden, logits, greedy = self.bodies.verify(meta.max_seq_len, *step, limit, self.cache)
            # The real rows' logits and drafts, for the controls, logprobs or the eager rejection
            # (a step whose outcome a graph computes makes none: each op is host time).
            if from_graph and not ask:
                if uses_controls:   # the controls graph, on the verify graph's logits
                    tables = self._tables(logits)
                    self.graphs.controls(tables.prepare(reqs), tables.tensors())
            elif not plain:
                if R < n:
                    limit = limit[:R]
                # (a batch that fills its graph size takes views without slicing rows)
                logits = logits.view(n, B, -1) if R == n else logits.view(n, B, -1)[:R]
                drafts = token_ids.view(n, B)[:, 1:] if R == n else token_ids.view(n, B)[:R, 1:]   # [R, k]: d_1..d_k
                # Bundle index j samples the token at position num_computed + 1 + j.
                # The generation controls at every bundle position (drafts before it count as generated).
                processed = self._controls(logits, drafts, reqs, captured=self.graphs is not None)
                masks = None if pending is None else pending.join()   # the worker's masks, to the device
        except BaseException:
            if pending is not None:   # nothing else touches the matchers while the worker does
                pending.settle()
            raise
        controlled = uses_controls or masks is not None
        in_buffers = False   # the proposal reads the step's outcome (every row) where a graph left it
        if from_graph:   # (either graph also left its tokens where the proposal reads them)
            graph_out = self.graphs.controls_outcome if all_greedy else self.graphs.sample(reqs, controlled)
            in_buffers = self.tp.size == 1
            if self.tp.size > 1:   # rank 0 decides
                out = self.tp.broadcast(graph_out[:R].contiguous())
            else:
                out = graph_out if R == n else graph_out[:R]
            packed = out.tolist()
            tok_list = [row[:B] for row in packed]
            emitted_counts = [row[B] for row in packed]
            finite_list = [row[B + 1:2 * B + 1] for row in packed]
            dead = self._dead_ends([row[2 * B + 1:] for row in packed], emitted_counts) if controlled else {}
            if ask or not in_buffers:   # tensors for the logprobs or the proposal
                tokens, num_emitted = out[:, :B], out[:, B]
        elif plain or (all_greedy and not controlled and self.greedy_in_step):
            # The verify body's own outcome (sampling/rejection.greedy_verify, the rule
            # rejection_sample applies to greedy rows): tokens, num_emitted and the finite check
            # per row, read back at once.
            if self.tp.size > 1:   # rank 0 decides
                out = self.tp.broadcast((greedy if R == n else greedy[:R]).contiguous())
                packed = out.tolist()
            else:
                out = greedy
                packed = greedy.tolist()[:R]
            tok_list = [row[:B] for row in packed]
            emitted_counts = [row[B] for row in packed]
            finite_list = [row[B + 1:] for row in packed]
            dead = {}
            in_buffers = self.graphs is not None and self.tp.size == 1
            if not (plain and in_buffers):   # tensors for the logprobs or the proposal
                out = out if R == n or self.tp.size > 1 else out[:R]
                tokens, num_emitted = out[:, :B], out[:, B]
        else:
            if masks is not None:   # after the controls, in place, the constrained rows only
                processed = masks.apply(processed, reqs, keep_raw=processed is logits)
            sampling = self._sampling([r.params for r in reqs])
            tokens, num_emitted = rejection_sample(processed, drafts, limit, sampling, [r.seed for r in reqs],
                                                   [r.num_computed + 1 for r in reqs])
            # A row whose logits are not finite where they decide its tokens (NaN / inf weights or
            # activations) ends its request with an error; the other rows go on. amax shows NaN and
            # +inf (and a row of -inf): two ops per step, the rest on the host.
            finite = torch.isfinite(logits.amax(-1)).long()                     # [R, B]
            # Where the controls (and a grammar) left no token at all: a dead end (see _dead_ends).
            live = self._live(logits, processed, controlled)                     # [R, B]
            if self.tp.size > 1:  # one broadcast for all four: rank 0 decides
                both = self.tp.broadcast(torch.cat([tokens, num_emitted[:, None], finite, live], dim=1))
                tokens, num_emitted = both[:, :B], both[:, B]
                finite, live = both[:, B + 1:2 * B + 1], both[:, 2 * B + 1:]
            emitted_counts, tok_list, finite_list = num_emitted.tolist(), tokens.tolist(), finite.tolist()
            dead = self._dead_ends(live.tolist(), emitted_counts) if controlled else {}
        # Logprobs before the drafter runs (its replay may reuse the logits' buffers): bundle
        # index j of row i is the target's distribution at the token of position num_computed + 1 + j.
        step_lps = {}
        if ask:
            raw = logits if masks is None else masks.raw_logits(logits)
            per_row = step_logprobs(raw[ask], processed[ask], tokens[ask], [reqs[i].params for i in ask],
                                    [emitted_counts[i] for i in ask])
            step_lps = dict(zip(ask, per_row))
        new_drafts = [[] for _ in reqs]
        if self.drafter is not None:
            def propose(draft_masks):
                if in_buffers:
                    drafts_out = self.graphs.propose(None, None, draft_masks)   # every row's, padded ones too
                elif self.graphs is not None:
                    drafts_out = self.graphs.propose(tokens, num_emitted, draft_masks)
                else:  # eager: no padded rows (n == R), so what was emitted is every row's
                    drafts_out = self.bodies.propose(meta.max_seq_len, hidden, tokens.reshape(-1), num_emitted,
                                                     *step, self.cache, draft_masks)
                if self.tp.size > 1:   # rank 0 decides, for the real rows
                    drafts_out = self.tp.broadcast(drafts_out[:R].contiguous())
                return drafts_out.tolist()[:R]
            # constrained rows draft under their grammar (after what they emitted)
            draft_masks = self._draft_masks(reqs, masks, [tok_list[i][:emitted_counts[i]] for i in range(R)])
            new_drafts = self._constrained_drafts(propose, draft_masks)
        results = [ReqResult(tok_list[i][:emitted_counts[i]], emitted_counts[i], limit_list[i], new_drafts[i])
                   for i in range(R)]
        for i, lps in step_lps.items():
            results[i].logprobs = lps
        for i in range(R):
            if not all(finite_list[i][:limit_list[i] + 1]):
                results[i].error = non_finite(reqs[i], f"verify step {reqs[i].num_steps}", reqs[i].num_computed)
            elif i in dead:   # the tokens before the dead end are kept, then the request ends
                results[i].error = no_token_left(reqs[i], reqs[i].num_computed + 1 + dead[i])
                results[i].tokens_before_error = dead[i]
        for i, msg in ({} if masks is None else masks.errors).items():
            results[i].error = msg
        return results


def no_token_left(r, position: int) -> str:
    what = dead_end_problem(r.params, r.grammar is not None)
    return (f"the generation controls left no token that may be generated at position {position} of request "
            f"{r.req_id} (output token {position - len(r.prompt_token_ids)}): {what} ban every token there; relax "
            "them (allowed_token_ids that bad_words, min_tokens' stop ids and the grammar do not all exclude)")


def non_finite(r, step: str, position: int) -> str:
    return (f"the model's logits were not finite (NaN or inf) at {step} of request {r.req_id} (position "
            f"{position}); its weights or activations overflowed: check the checkpoint (non-finite weights "
            "are refused at load) and the dtype (float32 or bfloat16 rather than float16)")
