"""The generation controls as they were before they moved into the captured step (mtpkit at
commit 3ee0ad5, sampling/controls.py, verbatim but for a no-op `release`): eager, per
request, after the verify graph. benchmarks/controls_cost.py runs it as the "before" of its
before / after comparison, in the same run as the current implementation.
"""

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from mtpkit.sampling.params import SamplingParams
from mtpkit.shapes import Bool, Float, Int, Tensor, checked


@runtime_checkable
class ControlledRequest(Protocol):
    """What the controls read of a request (engine.request.Request); `controls` holds its state."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    drafts: list[int]                  # what the step feeds after the last output token (verify: d_1..d_k)
    controls: "ControlState | None"


@dataclasses.dataclass
class ControlState:
    """A request's device state for its controls; None fields: the control is off."""

    counts: Float[Tensor, "vocab"] | None        # output tokens' counts (penalties)
    prompt_seen: Bool[Tensor, "vocab"] | None    # the prompt's tokens (repetition_penalty)
    static: Float[Tensor, "vocab"] | None        # logit_bias, -inf outside allowed ids / at one-token bad words
    multi_words: list[list[int]]                 # bad words of 2+ tokens (checked per position on the host)
    stop_ids: list[int]                          # eos and stop_token_ids (min_tokens)
    num_counted: int = 0                         # output tokens in counts

    def release(self) -> None:   # (added: the scheduler gives the new implementation's slots back)
        pass


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def build_state(r: ControlledRequest, vocab: int, dtype: torch.dtype, device) -> ControlState:
    """A request's state from its prompt and output tokens (at its first step, and after a preemption)."""
    p = r.params
    counts = seen = static = None
    if _penalized(p):
        counts = torch.zeros(vocab, dtype=dtype, device=device)
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(r.prompt_token_ids, dtype=torch.int64, device=device)] = True
    words = [list(w) for w in (p.bad_words or [])]
    singles = [w[0] for w in words if len(w) == 1]
    if p.logit_bias or p.allowed_token_ids is not None or singles:
        static = torch.zeros(vocab, dtype=dtype, device=device)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
            static[ids] = torch.tensor(list(p.logit_bias.values()), dtype=dtype, device=device)
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=device)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=device)] = True
            static.masked_fill_(~keep, float("-inf"))
        if singles:
            static[torch.tensor(singles, dtype=torch.int64, device=device)] = float("-inf")
    stop_ids = sorted(set(r.eos_token_ids) | set(p.stop_token_ids)) if p.min_tokens > 0 else []
    state = ControlState(counts, seen, static, [w for w in words if len(w) > 1], stop_ids)
    sync_counts(state, r.output_token_ids)
    return state


def sync_counts(state: ControlState, outputs: list[int]) -> None:
    """Count the output tokens emitted since the state's last step (one small scatter)."""
    new = outputs[state.num_counted:]
    if state.counts is not None and new:
        idx = torch.tensor(new, dtype=torch.int64, device=state.counts.device)
        state.counts.index_add_(0, idx, torch.ones(len(new), dtype=state.counts.dtype, device=idx.device))
    state.num_counted = len(outputs)


def _bans(r: ControlledRequest, state: ControlState, drafts: list[int], bundle: int) -> list[tuple[int, int]]:
    """(bundle position, token) pairs banned for this row: multi-token bad words whose prefix
    ends the output (with the drafts before the position), and the stop ids where the output
    is still shorter than min_tokens."""
    out = []
    n_out = len(r.output_token_ids)
    if state.multi_words:
        longest = max(len(w) for w in state.multi_words)
        ctx = r.output_token_ids[-(longest - 1):] + drafts[:bundle - 1]
        base = len(ctx) - len(drafts[:bundle - 1])       # ctx[:base + j]: what precedes position j
        for j in range(bundle):
            end = base + j
            for w in state.multi_words:
                m = len(w) - 1
                if end >= m and ctx[end - m:end] == w[:-1]:
                    out.append((j, w[-1]))
    for j in range(min(bundle, max(r.params.min_tokens - n_out, 0))):
        out.extend((j, t) for t in state.stop_ids)
    return out


@checked
def cumulative_draft_counts(drafts: Int[Tensor, "num_reqs num_spec"], bundle: int, vocab: int,
                            dtype: torch.dtype) -> Float[Tensor, "num_reqs bundle vocab"]:
    """[row, j, t]: how often t occurs among the row's drafts d_1..d_j (those before position j)."""
    onehot = torch.zeros(drafts.shape[0], bundle, vocab, dtype=dtype, device=drafts.device)
    if bundle > 1:
        onehot[:, 1:].scatter_(-1, drafts[:, :bundle - 1, None], 1.0)
    return onehot.cumsum(1)


@checked
def controlled_logits(
    logits: Float[Tensor, "num_reqs bundle vocab"],
    drafts: Int[Tensor, "num_reqs bundle-1"],
    reqs: Sequence[ControlledRequest],
) -> Float[Tensor, "num_reqs bundle vocab"]:
    """The processed logits of a step (module docstring). `drafts[i]` are the tokens row i feeds
    after its last output token (d_1..d_k; none after a prefill). The same tensor when no row
    uses a control; else a new one (fp32 at least), the rows without controls unchanged."""
    rows = [i for i, r in enumerate(reqs) if r.params.has_controls]
    if not rows:
        return logits
    B, V = logits.shape[1:]
    out = logits if logits.dtype == torch.float64 else logits.float()
    out = out.clone()
    dtype, device = out.dtype, out.device
    states = []
    for i in rows:
        r = reqs[i]
        if r.controls is None or r.controls.num_counted > len(r.output_token_ids):
            r.controls = build_state(r, V, dtype, device)
        else:
            sync_counts(r.controls, r.output_token_ids)
        states.append(r.controls)
    idx = torch.tensor(rows, dtype=torch.int64, device=device)
    x = out[idx]                                                   # [rows, B, V]
    with_static = [a for a, s in enumerate(states) if s.static is not None]
    if with_static:
        x[with_static] += torch.stack([states[a].static for a in with_static])[:, None, :]
    pen = [a for a, s in enumerate(states) if s.counts is not None]
    if pen:
        ps = [reqs[rows[a]].params for a in pen]

        def col(vals: list[float]) -> torch.Tensor:   # one value per penalised row, broadcast over [bundle, vocab]
            return torch.tensor(vals, dtype=dtype, device=device)[:, None, None]
        cnt = torch.stack([states[a].counts for a in pen])[:, None, :] + cumulative_draft_counts(
            drafts[idx[pen]], B, V, dtype)
        seen = torch.stack([states[a].prompt_seen for a in pen])[:, None, :] | (cnt > 0)
        y = x[pen]
        rep = torch.where(seen, col([p.repetition_penalty for p in ps]), torch.ones((), dtype=dtype, device=device))
        y = torch.where(y > 0, y / rep, y * rep)
        y = y - col([p.frequency_penalty for p in ps]) * cnt - col([p.presence_penalty for p in ps]) * (cnt > 0)
        x[pen] = y
    banned = []
    for a, (i, s) in enumerate(zip(rows, states)):
        banned.extend((a, j, t) for j, t in _bans(reqs[i], s, reqs[i].drafts, B))
    if banned:
        a_, j_, t_ = torch.tensor(banned, dtype=torch.int64, device=device).unbind(1)
        x[a_, j_, t_] = float("-inf")
    out[idx] = x
    return out
