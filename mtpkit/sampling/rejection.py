"""Lossless verification of drafts against the target (one batched call per verify step).

Every row first decides the target's own token at each bundle position j (the token at
absolute position positions[row] + j): the argmax for greedy rows; for random rows the
exponential race argmax_i p_i / E_i, whose E are a function of (request seed, position) only
(mtpkit.sampling.sampler). A draft is accepted while it equals the target's token at its position and
the draft limit allows; the row emits the accepted drafts, then the target's token at the
first position not accepted (the correction at a mismatch, the bonus after the last allowed
draft). tokens[i, :num_emitted[i]] is therefore the target's tokens at those positions, and
the output is the target's own sampling whatever the drafts: greedy decoding for greedy rows,
for seeded random rows the very tokens the same seed gives without speculation.

Lossless for random rows, in the standard rejection-sampling terms: the drafter is greedy, so
its q is one-hot on the draft d. The race's winner is distributed as p, so d is accepted with
probability p(d) = min(1, p(d)/q(d)); given a mismatch the winner is distributed as p
restricted to tokens != d and renormalised, which is normalise(max(p - q, 0)). That is
standard rejection sampling, coupled so that it needs no separate uniform: the emitted tokens
are distributed exactly as sampling the target alone. Each random row draws bundle * vocab
noise values per step whatever is accepted, and all-greedy steps draw nothing.

With num_spec = 0 (bundle 1) this is plain sampling: one path for both.

The acceptance rule is `accepted_prefix`, one function for every caller: `rejection_sample`
(eager, any sampling settings, the step's real rows) and, as tensor ops only (no host reads, no
data-dependent shapes) for the captured step (engine/step_bodies.py: every row of a graph size,
padded ones too) so that a step reads back one small int tensor: `greedy_verify` (all-greedy steps; the verify body), `controlled_greedy_verify` (the
controls body) and `sampled_verify` (steps with random rows; the sample body), which draws
the same tokens as `rejection_sample` from the same p and noise.
"""

import torch

from mtpkit.shapes import Float, Int, Tensor, checked
from mtpkit.sampling.sampler import SamplingTensors, keyed_positions, race, sample_tokens, target_probs


@checked
def rejection_sample(
    logits: Float[Tensor, "num_reqs bundle vocab"],
    drafts: Int[Tensor, "num_reqs bundle-1"],
    draft_limit: Int[Tensor, "num_reqs"],
    st: SamplingTensors,
    seeds: list,
    positions: list,
) -> tuple[Int[Tensor, "num_reqs bundle"], Int[Tensor, "num_reqs"]]:
    """Returns (tokens, num_emitted): row i emits tokens[i, :num_emitted[i]], which are its
    accepted drafts followed by one target token; num_emitted - 1 drafts were accepted.
    `draft_limit[i]` caps the drafts that may be accepted (a request near max_model_len or
    max_tokens drafts only what fits); drafts past it are never accepted.
    `seeds[i]`: row i's sampling seed (None for a greedy row); `positions[i]`: the absolute
    position of the token sampled at bundle index 0 (index j samples position + j)."""
    target = logits.argmax(-1)
    if not st.all_greedy:
        rand = [i for i, g in enumerate(st.greedy.tolist()) if not g]
        probs = target_probs(logits, st)[rand]                          # p [random rows, B, V] fp32
        drawn = sample_tokens(probs, [seeds[i] for i in rand], [positions[i] for i in rand])
        target[rand] = drawn
    return target, accepted_prefix(target, drafts, draft_limit)


@checked
def accepted_prefix(target: Int[Tensor, "num_reqs bundle"], drafts: Int[Tensor, "num_reqs bundle-1"],
                    draft_limit: Int[Tensor, "num_reqs"]) -> Int[Tensor, "num_reqs"]:
    """num_emitted: 1 + the drafts accepted, those before the first that differs from the target's
    token at its position or passes the row's draft limit. Accepted drafts equal the target's
    tokens, so a row emits target[i, :num_emitted[i]]."""
    k = drafts.shape[1]
    allowed = torch.arange(k, device=drafts.device)[None, :] < draft_limit[:, None]
    stop = (drafts != target[:, :k]) | ~allowed
    # The first stop (argmax returns the first maximum), a sentinel column ending every row at k:
    # a reduction a compiled graph fuses, where a cumprod is an extern call (~30 us a step here).
    return torch.cat([stop, stop.new_ones(stop.shape[0], 1)], dim=1).long().argmax(-1) + 1


@checked
def greedy_verify(logits: Float[Tensor, "num_reqs_padded bundle vocab"], drafts: Int[Tensor, "num_reqs_padded bundle-1"],
                  draft_limit: Int[Tensor, "num_reqs_padded"]) -> Int[Tensor, "num_reqs_padded 2*bundle+1"]:
    """A verify step's outcome if every row is greedy and nothing processes the logits (no
    generation control, no grammar), packed as one int tensor: [:, :bundle] the tokens
    (`rejection_sample`'s for greedy rows), [:, bundle] num_emitted, [:, bundle+1:] 1 where the
    logits at that bundle position are finite (amax shows NaN, +inf and a row of -inf).
    Graph-safe: the verify body computes it on every step; the runner reads it only when it
    applies, else it samples eagerly from the logits."""
    target = logits.argmax(-1)
    finite = torch.isfinite(logits.amax(-1)).long()
    return torch.cat([target, accepted_prefix(target, drafts, draft_limit)[:, None], finite], dim=1)


@checked
def controlled_greedy_verify(
    logits: Float[Tensor, "num_reqs_padded bundle vocab"], processed: Float[Tensor, "num_reqs_padded bundle vocab"],
    drafts: Int[Tensor, "num_reqs_padded bundle-1"], draft_limit: Int[Tensor, "num_reqs_padded"],
) -> Int[Tensor, "num_reqs_padded 3*bundle+1"]:
    """greedy_verify for an all-greedy step whose logits the generation controls processed:
    [:, :bundle] the tokens (`rejection_sample`'s on `processed` for greedy rows), [:, bundle]
    num_emitted, then per bundle position 1 where the raw `logits` are finite, then 1 where the
    processed ones leave some token (a dead end where 0). Graph-safe: the controls body computes
    it beside the processed logits, so such a step reads back one int tensor."""
    target = processed.argmax(-1)
    finite = torch.isfinite(logits.amax(-1)).long()
    live = torch.isfinite(processed.amax(-1)).long()
    return torch.cat([target, accepted_prefix(target, drafts, draft_limit)[:, None], finite, live], dim=1)


@checked
def sampled_verify(
    logits: Float[Tensor, "num_reqs_padded bundle vocab"], processed: Float[Tensor, "num_reqs_padded bundle vocab"],
    drafts: Int[Tensor, "num_reqs_padded bundle-1"], draft_limit: Int[Tensor, "num_reqs_padded"], st: SamplingTensors,
    seed_keys: Int[Tensor, "num_reqs_padded"], positions: Int[Tensor, "num_reqs_padded bundle"],
    steps: Int[Tensor, "vocab"],
) -> Int[Tensor, "num_reqs_padded 3*bundle+1"]:
    """`rejection_sample` on `processed` (the logits the generation controls left, or the logits
    themselves) as tensor ops only, packed like `controlled_greedy_verify`: [:, :bundle] the tokens,
    [:, bundle] num_emitted, then 1 where the raw `logits` are finite, then 1 where `processed`
    leaves some token. `seed_keys`: each row's sampler.seed_key (greedy rows: anything);
    `positions`: the absolute position each bundle index samples; `steps`: sampler.noise_steps
    (made outside the graph). Every row runs the race (a greedy row's one-hot p makes it its
    argmax), so its noise is drawn for every row."""
    target = race(target_probs(processed, st), keyed_positions(seed_keys, positions), steps)
    finite = torch.isfinite(logits.amax(-1)).long()
    live = torch.isfinite(processed.amax(-1)).long()
    return torch.cat([target, accepted_prefix(target, drafts, draft_limit)[:, None], finite, live], dim=1)
