"""Token bitmasks applied to logits: the device half of structured outputs.

A mask row is the grammar library's format (llguidance, as xgrammar and vLLM use): int32 words,
bit t % 32 of word t // 32 set when token t is allowed. A step's masks are one tensor
[num_constrained, bundle, vocab_words] for its constrained rows only (`rows` names them), so
rows without a constraint are neither copied nor touched (the op works in place). Forbidden tokens get -inf: greedy rows
take the argmax of what is allowed, random rows' softmax gives them probability 0, and a draft
the mask forbids can never equal the target's token, so rejection sampling rejects it.
A drafter's pass masks its logits [draft_rows, vocab] the same way (`DraftMask`: one row of
words per constrained draft row), so its argmax is a token the grammar allows.
"""

import torch

from mtpkit.shapes import Bool, Float, Int, Tensor, checked, shaped_dataclass


@checked
def allowed_tokens(bitmask: Int[Tensor, "num_constrained bundle vocab_words"], vocab: int
                   ) -> Bool[Tensor, "num_constrained bundle vocab"]:
    """Unpack the bits: True where the token is allowed (bits past `vocab` are dropped)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[..., None] >> shifts).bitwise_and_(1)               # arithmetic >> keeps bit 31 right
    return bits.flatten(-2)[..., :vocab].bool()


@checked
def apply_token_bitmask_(
    logits: Float[Tensor, "num_reqs bundle vocab"],
    bitmask: Int[Tensor, "num_constrained bundle vocab_words"],
    rows: Int[Tensor, "num_constrained"],   # noqa: F821 - a jaxtyping dimension, not a name
) -> Float[Tensor, "num_reqs bundle vocab"]:
    """Forbidden tokens of rows[c] set to -inf, in place (only those rows are read and written);
    returns `logits`."""
    logits[rows] = logits[rows].masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))
    return logits


@shaped_dataclass
class DraftMask:
    """One draft pass's grammar masks: row rows[c] of the pass's logits keeps bitmask[c]'s tokens."""

    bitmask: Int[Tensor, "num_constrained vocab_words"]
    rows: Int[Tensor, "num_constrained"]   # noqa: F821 - a jaxtyping dimension, not a name

    @checked
    def apply_(self, logits: Float[Tensor, "draft_rows vocab"]) -> Float[Tensor, "draft_rows vocab"]:
        """Forbidden tokens of the constrained rows set to -inf, in place; returns `logits`."""
        apply_token_bitmask_(logits[:, None], self.bitmask[:, None], self.rows)
        return logits
