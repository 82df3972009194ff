"""The masks of one step, for the requests that have a grammar (Request.grammar).

`StructuredMasks.verify` splits a verify step's host work in two. Before the step is launched,
only what decides its inputs: per constrained request, sync the matcher and walk the drafts with
cheap checks (matcher.RequestGrammar.plan_bundle: constrained drafting may rewrite them, the draft
limits are capped). Then the full masks of bundle positions 0..limit (fill_bundle_masks) are
computed by one worker thread (llguidance drops the GIL while it computes a mask) WHILE the verify
forward runs, into one host tensor [num_constrained, bundle, vocab_words]; `PendingMasks.join`,
after the generation controls and before rejection sampling, waits for it and copies it to the
device once. Only the worker touches the matchers in that window, and the runner joins before
anything else does (an exception in the forward included). A request whose mask fill raises ends
with that error (its row stays unmasked); the other requests go on. `overlap = False` runs the
fill on the calling thread before the step instead (the A/B of benchmarks/structured_json.py).
`StepMasks.apply` masks the logits on the device, in place and on the constrained rows only
(sampling/bitmask.py), after the generation controls (sampling/controls.py), so a control never
lifts a token the grammar forbids. `prefill` computes the first token sampled after a prompt's
mask (bundle 1) on the calling thread, before its logits are sampled. A step without constrained
requests gets None and costs one list scan. `host_seconds` and `steps` add up the time the
calling thread spends here (the plan, the wait at the join, the copy) and the steps that had
constrained rows; `worker_seconds` the mask fills' time, on whichever thread ran them
(benchmarks/structured_json.py reads them).
`proposal` makes the masks of the drafter's passes after a step (structured/draft_masks.py:
constrained drafting, `masked_drafting`), computed on the calling thread pass by pass
(`draft_seconds`; `masked_proposals` counts the verify steps whose unmasked drafts were not all
allowed, so that their proposal ran again with the masks).
"""

import contextlib
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mtpkit.sampling.bitmask import apply_token_bitmask_
from mtpkit.shapes import Float, Int, Tensor, checked, shaped_dataclass
from mtpkit.structured.draft_masks import ProposalMasks


@shaped_dataclass
class StepMasks:
    bitmask: Int[Tensor, "num_constrained bundle vocab_words"]
    rows: Int[Tensor, "num_constrained"]   # noqa: F821 - a jaxtyping dimension, not a name
    row_list: list
    errors: dict = dataclasses.field(default_factory=dict)   # step row -> why its grammar cannot go on
    raw_rows: tuple | None = None      # (rows, their raw logits): constrained rows asking raw logprobs

    @checked
    def apply(self, logits: Float[Tensor, "num_reqs bundle vocab"], reqs: list, keep_raw: bool
              ) -> Float[Tensor, "num_reqs bundle vocab"]:
        """Mask the constrained rows of the step's logits (after the generation controls) in
        place; returns `logits`. `keep_raw`: they are the model's own logits (no control made a
        copy), so a constrained row asking for raw logprobs keeps a copy of its row first."""
        keep = [i for i in self.row_list if reqs[i].params.logprobs is not None
                and reqs[i].params.logprobs_mode != "processed"] if keep_raw else []
        if keep:
            self.raw_rows = (keep, logits[keep].clone())
        return apply_token_bitmask_(logits, self.bitmask, self.rows)

    @checked
    def raw_logits(self, logits: Float[Tensor, "num_reqs bundle vocab"]) -> Float[Tensor, "num_reqs bundle vocab"]:
        """The model's logits for raw logprobs: `logits` with the rows apply() saved put back."""
        if self.raw_rows is None:
            return logits
        keep, raw = self.raw_rows
        out = logits.clone()
        out[keep] = raw
        return out


class PendingMasks:
    """A verify step's masks being filled (by the worker, or already by the calling thread)."""

    def __init__(self, owner: "StructuredMasks", host: Int[Tensor, "num_constrained bundle vocab_words"], rows: list[int], errors: dict,
                 job: Future | None):
        self.owner, self.host, self.rows, self.errors, self.job = owner, host, rows, errors, job

    def wait(self) -> None:
        """Until the worker is done with the matchers (a fill's exception is the step's: raised here)."""
        if self.job is not None:
            t0 = time.perf_counter()
            try:
                self.job.result()
            finally:
                self.job = None
                self.owner.host_seconds += time.perf_counter() - t0

    def settle(self) -> None:
        """Until the worker is done, its exception dropped (the step already failed otherwise)."""
        with contextlib.suppress(Exception):
            self.wait()

    def join(self) -> StepMasks:
        self.wait()
        t0 = time.perf_counter()
        masks = self.owner._to_device(self.host, self.rows, self.errors)
        self.owner.host_seconds += time.perf_counter() - t0
        return masks


class StructuredMasks:
    def __init__(self, device: torch.device):
        self.device = device
        self.constrained_drafting = True   # replace forbidden drafts by forced tokens (benchmarks turn it off)
        self.masked_drafting = True        # the drafters' argmax under the grammar masks (benchmarks turn it off)
        self.draft_seconds = 0.0           # the calling thread's time on the drafters' masks
        self.masked_proposals = 0          # verify steps whose proposal ran again with the masks
        self.overlap = True                # verify masks filled by the worker during the forward
        self.host_seconds, self.steps = 0.0, 0   # the calling thread's time here, steps with constrained rows
        self.worker_seconds = 0.0          # the mask fills' time, on whichever thread ran them
        self._worker: ThreadPoolExecutor | None = None   # one thread, made on first use, reused

    def verify(self, reqs: list, limits: list[int], bundle: int) -> PendingMasks | None:
        """Plans a verify step's constrained rows (caps `limits` in place, may rewrite each
        r.drafts) and starts their masks' fill; the caller joins the result after the forward."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        host = self._host(reqs[rows[0]].grammar.vocab_words, len(rows), bundle)
        errors, work = {}, []
        for c, i in enumerate(rows):
            r = reqs[i]
            err = r.grammar.sync(r.output_token_ids)
            if err is not None:
                errors[i] = err
                continue
            r.drafts = list(r.drafts)
            limits[i] = r.grammar.plan_bundle(r.drafts, limits[i], self.constrained_drafting)
            work.append((i, r.grammar, r.drafts, limits[i], host[c]))
        job = None
        if work and self.overlap:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtpkit-masks")
            job = self._worker.submit(self._fill, work, errors)
        elif work:
            self._fill(work, errors)
        self.host_seconds += time.perf_counter() - t0
        self.steps += 1
        return PendingMasks(self, host, rows, errors, job)

    # the host tensor is an inference tensor: writing it needs the mode, which is per thread
    @torch.inference_mode()
    def _fill(self, work: list, errors: dict) -> None:
        """The masks of the planned rows (the worker's job). A row whose fill raises gets that
        error (its grammar rolled back by fill_bundle_masks, its row unmasked)."""
        t0 = time.perf_counter()
        try:
            for i, grammar, drafts, limit, out in work:
                try:
                    grammar.fill_bundle_masks(drafts, limit, out)
                except Exception as e:  # noqa: BLE001 - that request's failure (any), not the step's
                    out.fill_(-1)
                    errors[i] = f"computing the grammar's masks failed ({type(e).__name__}: {e})"
        finally:
            self.worker_seconds += time.perf_counter() - t0

    def proposal(self, reqs: list, emitted: list[list[int]], errors: dict) -> ProposalMasks | None:
        """The drafter's per-pass masks after a step in which reqs[i] emitted emitted[i] (draft
        row i is reqs[i]); None when no row is constrained (or masked drafting is off). Rows in
        `errors` (their grammar cannot go on: the request ends) are left unmasked. The caller
        closes it after the proposal (rolling the matchers back)."""
        if not self.masked_drafting:
            return None
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and i not in errors]
        if not rows:
            return None
        return ProposalMasks(rows, [reqs[i].grammar for i in rows], [emitted[i] for i in rows], self.device,
                             self._add_draft_seconds)

    def _add_draft_seconds(self, seconds: float) -> None:
        self.draft_seconds += seconds

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def prefill(self, reqs: list) -> StepMasks | None:
        """Masks of the first token sampled after each finished prompt (bundle 1)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        host = self._host(reqs[rows[0]].grammar.vocab_words, len(rows), 1)
        errors = {}
        for c, i in enumerate(rows):
            r = reqs[i]
            err = r.grammar.sync(r.output_token_ids)
            if err is not None:
                errors[i] = err
                continue
            t1 = time.perf_counter()
            r.grammar.fill_mask(host[c, 0])
            self.worker_seconds += time.perf_counter() - t1
        masks = self._to_device(host, rows, errors)
        self.host_seconds += time.perf_counter() - t0
        self.steps += 1
        return masks

    def _host(self, words: int, n: int, bundle: int) -> torch.Tensor:
        # -1: every bit set, so positions past a row's limit (never emitted) stay unmasked
        return torch.full((n, bundle, words), -1, dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")

    @checked
    def _to_device(self, host: Int[Tensor, "num_constrained bundle vocab_words"], rows: list[int], errors: dict
                   ) -> StepMasks:
        return StepMasks(host.to(self.device, non_blocking=True),
                         torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True), rows, errors)
