"""The masks of one step, for the requests that have a grammar (Request.grammar).

`StructuredMasks.verify` runs on the host before the verify step is launched (constrained
drafting may rewrite the drafts it feeds): per constrained request, the masks of bundle
positions 0..limit (matcher.RequestGrammar.bundle_masks), into one host tensor
[num_constrained, bundle, vocab_words] copied to the device once; `StepMasks.apply` masks the
logits there, in place and on the constrained rows only (sampling/bitmask.py), before rejection
sampling and after the generation controls (sampling/controls.py), so a control never lifts
a token the grammar forbids. `prefill` does the same for the
first token sampled after a prompt (bundle 1). A step without constrained requests gets None
and costs one list scan. `host_seconds` and `steps` add up the time spent here and the steps
that had constrained rows (benchmarks/structured_json.py reads them).
"""

import dataclasses
import time

import torch

from mtpkit.sampling.bitmask import apply_token_bitmask_
from mtpkit.shapes import Float, Int, Tensor, checked, shaped_dataclass


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

    def raw_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits for raw logprobs: `logits` with the rows apply() saved put back."""
        if self.raw_rows is None:
            return logits
        keep, raw = self.raw_rows
        out = logits.clone()
        out[keep] = raw
        return out


class StructuredMasks:
    def __init__(self, device: torch.device):
        self.device = device
        self.constrained_drafting = True   # replace forbidden drafts by forced tokens (benchmarks turn it off)
        self.host_seconds, self.steps = 0.0, 0   # time spent here, over steps with constrained rows

    def verify(self, reqs: list, limits: list[int], bundle: int) -> StepMasks | None:
        """Masks of a verify step; caps `limits` in place and may rewrite each r.drafts."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        host = self._host(reqs[rows[0]].grammar.vocab_words, len(rows), bundle)
        errors = {}
        for c, i in enumerate(rows):
            r = reqs[i]
            err = r.grammar.sync(r.output_token_ids)
            if err is not None:
                errors[i] = err
                continue
            r.drafts = list(r.drafts)
            limits[i] = r.grammar.bundle_masks(r.drafts, limits[i], host[c], self.constrained_drafting)
        masks = self._to_device(host, rows, errors)
        self.host_seconds += time.perf_counter() - t0
        self.steps += 1
        return masks

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
            r.grammar.fill_mask(host[c, 0])
        masks = self._to_device(host, rows, errors)
        self.host_seconds += time.perf_counter() - t0
        self.steps += 1
        return masks

    def _host(self, words: int, n: int, bundle: int) -> torch.Tensor:
        # -1: every bit set, so positions past a row's limit (never emitted) stay unmasked
        return torch.full((n, bundle, words), -1, dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")

    def _to_device(self, host: torch.Tensor, rows: list[int], errors: dict) -> StepMasks:
        return StepMasks(host.to(self.device, non_blocking=True),
                         torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True), rows, errors)
