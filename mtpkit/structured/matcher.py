"""A request's grammar state under speculation.

The matcher has consumed exactly the request's output tokens (`num_consumed`): `sync` brings it
up to the outputs at the start of every step that samples for the request, so it follows what
was really emitted whatever happened in between (a stop that cut a bundle, a preemption and
recompute, which keeps the outputs, a step interrupted before its results were applied).

`bundle_masks` is the verify step's host work: the mask at bundle position j is the state after
drafts 0..j-1, so it consumes the drafts one by one, writing each position's mask, and rolls
all of them back; the emitted ones (accepted drafts + the target's token) are consumed at the
next sync. It stops at the first draft the grammar forbids: that draft's mask forbids it, so it
is rejected whatever the target's logits, and no later draft can be accepted; the draft limit is
capped there (the same outcome, no masks to compute past it). Constrained drafting replaces such
a draft by the token the grammar forces there (llguidance's fast-forward tokens; eos once the
structure is complete), when there is one, instead of stopping: any draft is lossless (it only
decides how many of the target's own tokens a step emits), and a forced one is accepted.
"""

import llguidance
import torch


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

    def fill_mask(self, out: torch.Tensor) -> None:
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

    def bundle_masks(self, drafts: list[int], limit: int, out: torch.Tensor, constrained_drafting: bool
                     ) -> int:
        """Masks of bundle positions 0..limit into out [bundle, vocab_words] (host int32, rows past
        the returned limit untouched); `drafts` may be rewritten in place (constrained drafting).
        Returns the draft limit, capped at the first draft the grammar forbids."""
        consumed = 0
        try:
            for j in range(limit + 1):
                self.fill_mask(out[j])
                if j == limit:
                    break
                if not allowed(out[j], drafts[j]):
                    forced = self.forced_token() if constrained_drafting else None
                    if forced is None or not allowed(out[j], forced):
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


def allowed(mask_row: torch.Tensor, token: int) -> bool:
    """Whether `token`'s bit is set in a host mask row."""
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)
