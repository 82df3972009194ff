"""Logprobs of sampled and prompt tokens: one log_softmax and one topk over the rows that ask.

`Logprob` is what the user gets (vLLM's names). Two modes (SamplingParams.logprobs_mode):
- "raw": log_softmax of the model's logits (vLLM's default);
- "processed": the log of the distribution the token was actually sampled from: the
  generation controls of sampling/controls.py (bias, allowed ids, bad words, min_tokens,
  penalties, with the drafts before each position counted as generated), then the target
  distribution of sampling/sampler.py (temperature, then min-p, top-k, top-p); tokens they
  removed get -inf. A greedy row's processed logprobs are log_softmax of its controlled
  logits (its target is their argmax, a one-hot whose log says nothing): its raw ones when
  it uses no control.
Prompt logprobs are always raw: no token was sampled there.

Under speculation a verify step's logits row j is the target's at the token of position
num_computed + 1 + j, so an accepted draft gets the target's logprobs there, never the
drafter's. Rows that ask nothing are never touched; the host work is proportional to the rows
that ask (times their top-N).
"""

import dataclasses

import torch

from mtpkit.sampling.params import SamplingParams
from mtpkit.sampling.sampler import SamplingTensors, target_probs
from mtpkit.shapes import Float, Int, Tensor, checked


@dataclasses.dataclass
class Logprob:
    """A token's log-probability, its rank (1 = likeliest) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:   # a dtype helper: the callers are typed
    """fp32 for half-precision logits; a float64 model's stay float64 (its tests compare to 1e-9)."""
    return logits if logits.dtype == torch.float64 else logits.float()


@checked
def topk_logprobs(
    logprobs: Float[Tensor, "num_logits vocab"], tokens: Int[Tensor, "num_logits"], num_top: int,
) -> tuple[Float[Tensor, "num_logits"], Int[Tensor, "num_logits"],
           Float[Tensor, "num_logits num_logprobs"], Int[Tensor, "num_logits num_logprobs"]]:
    """(logprob of each row's token, its rank: 1 + tokens strictly likelier, the top num_top
    logprobs, their token ids)."""
    own = logprobs.gather(-1, tokens[:, None])
    rank = (logprobs > own).sum(-1) + 1
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    empty_f = logprobs.new_zeros(logprobs.shape[0], 0)
    return (own[:, 0], rank, top.values if top else empty_f,
            top.indices if top else empty_f.long())


@checked
def processed_logprobs(
    logits: Float[Tensor, "num_reqs bundle vocab"], controlled: Float[Tensor, "num_reqs bundle vocab"],
    params: list[SamplingParams],
) -> Float[Tensor, "num_reqs bundle vocab"]:
    """Logprobs (fp32, float64 for a float64 model) of each row in its own mode (module
    docstring); `controlled`: the logits after the generation controls (sampling/controls.py)."""
    raw = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    greedy = [i for i, p in enumerate(params) if p.logprobs_mode == "processed" and p.temperature == 0
              and p.has_controls]
    if greedy:
        raw[greedy] = torch.log_softmax(_at_least_fp32(controlled[greedy]), dim=-1).to(raw.dtype)
    sampled = [i for i, p in enumerate(params) if p.logprobs_mode == "processed" and p.temperature > 0]
    if sampled:
        st = SamplingTensors.from_params([params[i] for i in sampled], logits.device)
        raw[sampled] = target_probs(controlled[sampled], st).log().to(raw.dtype)   # p is fp32
    return raw


def logprob_dicts(own, rank, top_vals, top_ids, tokens: list[int], num_tops: list[int]) -> list[dict]:
    """Host side of one step: per row (lists from .tolist()), {token: Logprob}: the row's token
    first, then its top num_tops[row] (the token's own entry even when outside them)."""
    out = []
    for lp, rk, vals, ids, t, n in zip(own, rank, top_vals, top_ids, tokens, num_tops):
        d = {t: Logprob(lp, rk)}
        for r, (v, i) in enumerate(zip(vals[:n], ids[:n]), start=1):
            if i not in d:
                d[i] = Logprob(v, r)
        out.append(d)
    return out


def step_logprobs(logits, controlled, tokens, params: list[SamplingParams], counts: list[int]) -> list[list[dict]]:
    """logits [A, B, V] (the model's), controlled [A, B, V] (after the generation controls) and
    tokens [A, B] of the A rows that ask; row a's first counts[a] positions are wanted. One
    log_softmax and one topk for the step; the host reads only those rows."""
    A, B, V = logits.shape
    num_top = min(max(p.logprobs for p in params), V)
    lp = processed_logprobs(logits, controlled, params).view(A * B, V)
    own, rank, vals, ids = topk_logprobs(lp, tokens.reshape(-1), num_top)
    own, rank = own.view(A, B).tolist(), rank.view(A, B).tolist()
    vals, ids = vals.view(A, B, -1).tolist(), ids.view(A, B, -1).tolist()
    tok = tokens.tolist()
    return [logprob_dicts(own[a][:c], rank[a][:c], vals[a][:c], ids[a][:c], tok[a][:c], [params[a].logprobs] * c)
            for a, c in enumerate(counts)]


def prompt_logprob_dicts(logits: Float[Tensor, "num_logits vocab"], next_tokens: Int[Tensor, "num_logits"],
                         num_tops: list[int]) -> list[dict]:
    """Raw logprobs of prompt tokens: row i's logits are those of the position before
    next_tokens[i]."""
    lp = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    own, rank, vals, ids = topk_logprobs(lp, next_tokens, min(max(num_tops), lp.shape[-1]))
    return logprob_dicts(own.tolist(), rank.tolist(), vals.tolist(), ids.tolist(), next_tokens.tolist(), num_tops)
