"""Constrained drafting: the grammar masks of a proposal's passes, for the constrained rows.

After a step (verify or prefill) the host knows what each constrained request emitted; the
drafter's pass j must take its argmax over the tokens the grammar allows after those emitted
tokens and drafts 0..j-1. `ProposalMasks` is the step's `DraftMasks` (mtpkit/step/draft.py): at
pass 0 each row's matcher consumes the emitted tokens, at pass j >= 1 the draft j - 1 it reads
back from the device (one round trip per pass, only in steps with constrained rows), then the
rows' masks are computed and copied to the device. `close` rolls every consumed token back, so
the matcher is again at the request's outputs (`RequestGrammar.num_consumed`); the next step's
sync consumes what was really emitted (a stop string may cut it).

The masked passes are eager (a host round trip each), so a step first runs the proposal as
usual (captured) and checks its drafts on the host (`allows_all`: cheap checks, no masks): when
every constrained row's drafts are allowed, they are what the masked passes would give, and are
kept; otherwise the proposal runs again with the masks (it writes the same KV slots again: the
second run's drafts and KV are the ones kept).

A row stops being masked (its later passes take the plain argmax) at an eos (the request ends
there: nothing after it is emitted, and llguidance 1.9.1 rolls an eos back wrongly), at a token
its grammar refuses (a row whose masks failed this step, which ends with that error) and when
computing its mask raises. Any draft is lossless: the masks only make the drafts tokens the
verify step can accept (the verify masks still check them: matcher.RequestGrammar.plan_bundle).
"""

import time

import torch

from mtpkit.sampling.bitmask import DraftMask
from mtpkit.shapes import Int, Tensor
from mtpkit.step.draft import DraftMasks
from mtpkit.structured.matcher import RequestGrammar


class ProposalMasks(DraftMasks):
    def __init__(self, rows: list[int], grammars: list[RequestGrammar], emitted: list[list[int]],
                 device: torch.device, timer=None):
        """`rows`: the draft rows constrained (indices into the proposal's rows), each with its
        request's grammar and the tokens the step emitted for it. `timer(seconds)` adds up the
        host time spent here."""
        self.rows, self.grammars, self.emitted, self.device = rows, grammars, emitted, device
        self.timer = timer
        self.consumed = [0] * len(rows)
        self.live = [True] * len(rows)
        self.passes = 0
        self._index = torch.tensor(rows, dtype=torch.int64, device=device)

    def __call__(self, j: int, previous: Int[Tensor, "draft_rows"] | None) -> DraftMask | None:  # noqa: F821 - a jaxtyping dimension, not a name
        t0 = time.perf_counter()
        try:
            if j != self.passes:   # the passes come in order: pass j's mask is after draft j - 1
                raise RuntimeError(f"draft pass {j} asked for its mask after pass {self.passes - 1}")
            self.passes += 1
            if j == 0:
                for c, tokens in enumerate(self.emitted):
                    self._feed(c, tokens)
            else:
                for c, token in enumerate(previous[self._index].tolist()):
                    self._feed(c, [token])
            return self._masks()
        finally:
            if self.timer is not None:
                self.timer(time.perf_counter() - t0)

    def allows_all(self, drafts: list[list[int]]) -> bool:
        """Whether every constrained row's drafts (drafts[row], from an unmasked proposal) are
        tokens its grammar allows one after another (up to an eos). Then the masked proposal
        would give the very same drafts (a pass's masked argmax is its plain argmax when that
        token is allowed, and the next pass reads only the drafts before it), so it need not
        run. The matchers are left as they were (no mask is computed)."""
        t0 = time.perf_counter()
        try:
            for c, row in enumerate(self.rows):
                self._feed(c, self.emitted[c])
                for t in drafts[row]:
                    if not self.live[c]:
                        break
                    g = self.grammars[c]
                    if t in g.eos_token_ids:
                        if not g.allows(t):
                            return False
                        break
                    if not g.allows(t):
                        return False
                    self._feed(c, [t])
            return True
        finally:
            self.close()
            self.live = [True] * len(self.rows)
            if self.timer is not None:
                self.timer(time.perf_counter() - t0)

    def _feed(self, c: int, tokens: list[int]) -> None:
        g = self.grammars[c]
        for t in tokens:
            if not self.live[c]:
                return
            if t in g.eos_token_ids or not g.allows(t) or not g.matcher.consume_token(t):
                self.live[c] = False
                return
            self.consumed[c] += 1

    def _masks(self) -> DraftMask | None:
        live = [c for c in range(len(self.rows)) if self.live[c]]
        if not live:
            return None
        host = torch.empty((len(live), self.grammars[live[0]].vocab_words), dtype=torch.int32)
        keep = []
        for k, c in enumerate(live):
            try:
                self.grammars[c].fill_mask(host[k])
                keep.append(k)
            except Exception:  # noqa: BLE001 - that row's drafts go unmasked; the verify masks report it
                self.live[c] = False
        if not keep:
            return None
        if len(keep) < len(live):
            host = host[keep]
        rows = torch.tensor([self.rows[live[k]] for k in keep], dtype=torch.int64)
        return DraftMask(host.to(self.device), rows.to(self.device))

    def close(self) -> None:
        """Every token consumed here rolled back: the matchers as they were before pass 0."""
        for c, n in enumerate(self.consumed):
            if n:
                self.grammars[c].matcher.rollback(n)
        self.consumed = [0] * len(self.rows)
