"""A request's grammar state under speculation.

The matcher has consumed exactly the request's output tokens (`num_consumed`): `sync` brings it
up to the outputs at the start of every step that samples for the request, so it follows what
was really emitted whatever happened in between (a stop that cut a bundle, a preemption and
recompute, which keeps the outputs, a step interrupted before its results were applied).

A verify step's host work is split in two (step_masks.py overlaps the second with the forward).
`plan_bundle`, before the step (it decides the step's inputs): walks the drafts with cheap checks
(`validate_tokens`, `consume_token`, fast-forward tokens; no mask) and rolls them back. It stops
at the first draft the grammar forbids: that draft's mask forbids it, so it is rejected whatever
the target's logits, and no later draft can be accepted; the draft limit is capped there (the
same outcome, no masks to compute past it). Constrained drafting replaces such a draft by the
token the grammar forces there (llguidance's fast-forward tokens; eos once the structure is
complete), when there is one, instead of stopping: any draft is lossless (it only decides how
many of the target's own tokens a step emits), and a forced one is accepted.
`fill_bundle_masks`, while the verify forward runs (a worker thread: llguidance's mask
computation drops the GIL): the mask at bundle position j is the state after drafts 0..j-1, so
it consumes the (rewritten) drafts one by one up to the planned limit, writing each position's
mask, and rolls all of them back; the emitted ones (accepted drafts + the target's token) are
consumed at the next sync. `bundle_masks` is the two in a row.
"""

import llguidance

# Host rows of the bitmask, typed with the shape names; not @checked: these run per token
# position (and on the mask worker thread), where a check would cost more than the work.
from mtpkit.shapes import Int, Tensor


class RequestGrammar:
    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids, vocab_size: int):
        self.matcher = matcher
        self.vocab_words = (vocab_size + 31) // 32      # the mask row's int32 words (the model's vocabulary)
        self.eos_token_ids = list(eos_token_ids)
        self.num_consumed = 0

    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def sync(self, output_token_ids: list[int]) -> str | None:
        """Consume the outputs not consumed yet; the grammar's error, if any."""
        new = output_token_ids[self.num_consumed:]
        if len(output_token_ids) < self.num_consumed:       # never: outputs only grow
            self.matcher.rollback(self.num_consumed - len(output_token_ids))
        elif new:
            self.matcher.consume_tokens(new)
        self.num_consumed = len(output_token_ids)
        err = self.error()
        return None if err is None else f"the grammar refused the output ({err.strip().splitlines()[0]})"

    def fill_mask(self, out: Int[Tensor, "vocab_words"]) -> None:
        """The current state's mask into `out` (a contiguous host int32 row of vocab_words)."""
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def forced_token(self) -> int | None:
        """The token the grammar forces next, if one is (its fast-forward tokens' first; eos once stopped)."""
        ff = self.matcher.compute_ff_tokens()
        if ff:
            return ff[0]
        if self.matcher.is_stopped() and self.eos_token_ids:
            return self.eos_token_ids[0]
        return None

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (the bit its mask would have; no mask computed)."""
        if token in self.eos_token_ids:    # validate_tokens refuses eos once the grammar stopped; the mask allows it
            return self.matcher.is_accepting()
        return 0 <= token < 32 * self.vocab_words and self.matcher.validate_tokens([token]) == 1

    def plan_bundle(self, drafts: list[int], limit: int, constrained_drafting: bool) -> int:
        """The draft limit, capped at the first draft the grammar forbids; `drafts` may be
        rewritten in place (constrained drafting). Leaves the matcher as it found it."""
        consumed = 0
        try:
            for j in range(limit):
                if not self.allows(drafts[j]):
                    forced = self.forced_token() if constrained_drafting else None
                    if forced is None or not self.allows(forced):
                        return j
                    drafts[j] = forced
                if drafts[j] in self.eos_token_ids:
                    # The request ends there: nothing after it is emitted, so it is not consumed
                    # (llguidance 1.9.1 rolls an eos back wrongly after a grammar that stopped).
                    return j + 1
                if not self.matcher.consume_token(drafts[j]):   # allowed, so never; the error shows at sync
                    return j
                consumed += 1
            return limit
        finally:
            if consumed:
                self.matcher.rollback(consumed)

    def fill_bundle_masks(self, drafts: list[int], limit: int, out: Int[Tensor, "bundle vocab_words"]) -> None:
        """Masks of bundle positions 0..limit (plan_bundle's drafts and limit) into out [bundle,
        vocab_words] (host int32; rows past the limit, and after an eos draft, untouched: never emitted)."""
        consumed = 0
        try:
            for j in range(limit + 1):
                self.fill_mask(out[j])
                if j == limit or drafts[j] in self.eos_token_ids:
                    return
                if not self.matcher.consume_token(drafts[j]):   # never: plan_bundle consumed it
                    return
                consumed += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)

    def bundle_masks(self, drafts: list[int], limit: int, out: Int[Tensor, "bundle vocab_words"],
                     constrained_drafting: bool
                     ) -> int:
        """plan_bundle then fill_bundle_masks, in a row: the capped draft limit."""
        limit = self.plan_bundle(drafts, limit, constrained_drafting)
        self.fill_bundle_masks(drafts, limit, out)
        return limit


def allowed(mask_row: Int[Tensor, "vocab_words"], token: int) -> bool:
    """Whether `token`'s bit is set in a host mask row."""
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)
