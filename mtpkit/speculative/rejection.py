"""Lossless verification of drafts against the target (one batched call per verify step).

Greedy rows accept drafts while draft == argmax(p_j) and then emit the argmax at the first
mismatch (the correction) or after the last draft (the bonus): exactly greedy decoding.
Random rows accept draft d with probability min(1, p(d)/q(d)); the drafter is greedy, so q is
one-hot on d and that is p(d). At the first rejection the token comes from
normalise(max(p - q, 0)); when every allowed draft is accepted it comes from p. The emitted
tokens are then distributed exactly as sampling the target alone.

With num_spec = 0 (bundle 1) this is plain sampling: one path for both.
"""

import torch

from ..shapes import Float, Int, Tensor, checked
from ..sampling import SamplingTensors, sample_rows, target_probs


@checked
def recovered_distribution(
    p: Float[Tensor, "num_reqs vocab"], draft: Int[Tensor, "num_reqs"]
) -> Float[Tensor, "num_reqs vocab"]:
    """normalise(max(p - q, 0)) for a one-hot q on the rejected draft: p without the draft.
    (Where p put all its mass on the draft the draft was never rejected; p is kept there.)"""
    residual = p.clone()
    residual[torch.arange(p.shape[0], device=p.device), draft] = 0.0
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


@checked
def rejection_sample(
    logits: Float[Tensor, "num_reqs bundle vocab"],
    drafts: Int[Tensor, "num_reqs bundle-1"],
    draft_limit: Int[Tensor, "num_reqs"],
    st: SamplingTensors,
    generators: list,
) -> tuple[Int[Tensor, "num_reqs bundle"], Int[Tensor, "num_reqs"]]:
    """Returns (tokens, num_emitted): row i emits tokens[i, :num_emitted[i]], which are its
    accepted drafts followed by one target token; num_emitted - 1 drafts were accepted.
    `draft_limit[i]` caps the drafts that may be accepted (a request near max_model_len or
    max_tokens drafts only what fits); drafts past it are never accepted."""
    R, B, _ = logits.shape
    k = B - 1
    pos = torch.arange(k, device=logits.device)
    allowed = pos[None, :] < draft_limit[:, None]
    if st.all_greedy:
        target = logits.argmax(-1)
        accept = (drafts == target[:, :k]) & allowed
        n_acc = accept.long().cumprod(-1).sum(-1)
        return target, n_acc + 1  # accepted drafts equal the argmax, so emit the argmax row

    probs = target_probs(logits, st)                                    # p [R, B, V] fp32
    greedy = st.greedy
    # Uniforms only for random rows, from each request's own generator.
    u = torch.stack([torch.zeros(k, device=logits.device) if gr else
                     torch.rand(k, generator=g, device=logits.device)
                     for g, gr in zip(generators, greedy.tolist())])
    p_draft = probs[:, :k].gather(-1, drafts[..., None])[..., 0]         # p_j(d_j)
    target = logits.argmax(-1)
    accept = torch.where(greedy[:, None], drafts == target[:, :k], u < p_draft) & allowed
    n_acc = accept.long().cumprod(-1).sum(-1)                          # accepted drafts per row
    rows = torch.arange(R, device=logits.device)
    final_p = probs[rows, n_acc]                                       # p at the first non-accepted position
    rejected = n_acc < draft_limit.clamp(max=k)                        # stopped by a rejection, not the limit
    if k:
        d = drafts.gather(-1, n_acc.clamp(max=k - 1)[:, None])[:, 0]
        final_p = torch.where(rejected[:, None], recovered_distribution(final_p, d), final_p)
    final = torch.where(greedy, target[rows, n_acc], 0)
    if bool((~greedy).any()):
        idx = (~greedy).nonzero()[:, 0]
        drawn = sample_rows(final_p[idx], [generators[i] for i in idx.tolist()])
        final = final.index_put((idx,), drawn)
    tokens = torch.cat([drafts, drafts.new_zeros(R, 1)], dim=1)
    tokens[rows, n_acc] = final
    return tokens, n_acc + 1
