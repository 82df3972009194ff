"""Generation controls on the logits: logit_bias, allowed_token_ids, bad_words, min_tokens,
repetition / presence / frequency penalties (SamplingParams; min_p is applied after
temperature, in sampler.target_probs).

`controlled_logits` turns a step's logits [num_reqs, bundle, vocab] into the processed logits
that rejection_sample decides from (greedy rows: their argmax; random rows: target_probs of
them), in vLLM's order: logit_bias and the -inf masks (allowed ids, bad words, min_tokens),
then the penalties (a -inf stays -inf through them). Every control is applied at bundle
position j as if the tokens came one at a time: the drafts d_1..d_j the step verifies before
position j count as already generated (penalty counts, bad-word prefixes, the output length
min_tokens compares with). The target's token at every position is therefore the token
sampling without drafts would give there, so speculation stays lossless with every control on.

Two parts:
- `apply_controls`, on the device and graph-safe (fixed shapes, no host reads): everything
  but multi-token bad words, vectorised over the batch. Each request that uses a control
  holds a slot (a row) of `ControlTables`: its output-token counts (penalties; updated from
  the tokens emitted since its last step by one scatter for the whole batch), the prompt's
  token set (repetition_penalty), a static additive row (logit_bias, -inf outside
  allowed_token_ids, at one-token bad words) and its stop-id mask (min_tokens). A step's
  per-row inputs (`ControlInputs`: slot, flag, the three penalties, how many bundle
  positions min_tokens still bans the stop ids at) are O(num_reqs) values in two tensors. Rows without a
  control (flag off; slot 0, a row of neutral values) come out as the input, unchanged. The
  eager paths (prefill, enforce_eager) call this function on the step's own tensors; a
  verify step with graphs replays it captured / traced on static buffers
  (graphs/captured.py, through engine/step_bodies.py's `controls` body): one implementation.
- `ban_bad_words`, eager: a bad word of 2+ tokens bans its last token at position j only
  where the output so far (with d_1..d_j) ends in its other tokens. How many (row, position,
  token) triples that gives depends on the tokens: a data-dependent shape, so it is a host
  walk (O(rows x words x bundle), never vocabulary-sized) and one indexed write of -inf, after
  the captured part (the -inf commutes with every other control).

Host work per step is proportional to the rows (their new tokens, their multi-token bad
words x bundle), never to vocab x tokens; a request's tables row is written once, when it
first needs it (and again after a preemption, from its prompt and output tokens). A batch in
which no request uses a control returns the logits untouched (today's exact path).

bad_words, as vLLM's: a sequence w of L > 1 tokens bans w[-1] wherever the output so far
(with the drafts before the position) ends in w[:-1]; a one-token sequence bans that token.
Only output tokens count (a word begun in the prompt is not completed by this rule).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
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
    """A request's host side of its controls: its slot in the tables and what is checked on the host."""

    tables: "ControlTables"
    slot: int
    penalized: bool                      # its counts are kept (a penalty is on)
    multi_words: list[list[int]]         # bad words of 2+ tokens (checked per position on the host)
    num_counted: int = 0                 # output tokens in its counts

    def release(self) -> None:
        """Give the slot back (the request finished or was preempted); idempotent."""
        if self.slot:
            self.tables.free(self.slot)
            self.slot = 0


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# A step's per-row values, packed in two tensors (two host-to-device copies a step, two static
# buffers in a graph): ROW_INTS[i] is row i of ControlInputs.ints, ROW_FLOATS of .floats; a row
# without a control has NEUTRAL_INTS / NEUTRAL_FLOATS (slot 0, off; no penalty, no min_tokens).
ROW_INTS = ("slot", "active", "min_left")     # min_left: bundle positions j < it ban the stop ids (min_tokens)
ROW_FLOATS = ("repetition", "presence", "frequency")
NEUTRAL_INTS, NEUTRAL_FLOATS = (0, 0, 0), (1.0, 0.0, 0.0)


@dataclasses.dataclass
class ControlInputs:
    """A step's per-row inputs of `apply_controls` (ROW_INTS, ROW_FLOATS) as host values:
    ints[f][i] is field f of row i. `tensors` makes them tensors (the eager paths); a captured
    step writes them into its static buffers from the host (numpy views on CPU: no tensor op)."""

    ints: list[list[int]]           # [3][num_reqs]
    floats: list[list[float]]       # [3][num_reqs]
    dtype: torch.dtype              # the tables' (the floats' tensor dtype)
    device: torch.device

    @staticmethod
    def bytes_for(num_slots: int, vocab: int, dtype: torch.dtype) -> int:
        """What the tables of `num_slots` rows take (the memory plan reserves it: they are
        allocated at the first step that uses a control, after the pools)."""
        return num_slots * vocab * (2 * dtype.itemsize + 2)

    def tensors(self) -> tuple[Int[Tensor, "3 num_reqs"], Float[Tensor, "3 num_reqs"]]:
        """In apply_controls' argument order."""
        return (torch.tensor(self.ints, dtype=torch.int64, device=self.device),
                torch.tensor(self.floats, dtype=self.dtype, device=self.device))


class ControlTables:
    """The device rows of the requests that use a control, one slot each (slot 0: neutral,
    never written). Sized for every running request (max_num_seqs + 1 rows), allocated when a
    step first needs them, never reallocated (a captured graph reads them in place)."""

    def __init__(self, num_slots: int, vocab: int, dtype: torch.dtype, device):
        self.vocab, self.dtype, self.device = vocab, dtype, torch.device(device)
        self.counts: Float[Tensor, "control_slots vocab"] = torch.zeros(num_slots, vocab, dtype=dtype, device=device)
        self.prompt_seen: Bool[Tensor, "control_slots vocab"] = torch.zeros(num_slots, vocab, dtype=torch.bool,
                                                                            device=device)
        self.static: Float[Tensor, "control_slots vocab"] = torch.zeros(num_slots, vocab, dtype=dtype, device=device)
        self.stop: Bool[Tensor, "control_slots vocab"] = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)
        self._free = list(range(num_slots - 1, 0, -1))
        # CPU: the counts as numpy, updated without a tensor op (each host op after a graph
        # runs with the caches cold, ~10 us)
        self._counts_host = self.counts.view(-1).numpy() if self.device.type == "cpu" else None

    @staticmethod
    def bytes_for(num_slots: int, vocab: int, dtype: torch.dtype) -> int:
        """What the tables of `num_slots` rows take (the memory plan reserves it: they are
        allocated at the first step that uses a control, after the pools)."""
        return num_slots * vocab * (2 * dtype.itemsize + 2)

    def tensors(self) -> tuple[Tensor, ...]:
        """In apply_controls' argument order."""
        return self.counts, self.prompt_seen, self.static, self.stop

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def _ids(self, ids) -> Tensor:
        return torch.tensor(list(ids), dtype=torch.int64, device=self.device)

    def build(self, r: ControlledRequest) -> ControlState:
        """A request's slot, written from its params and prompt (its first step, and after a
        preemption: its output tokens are counted by the next `prepare`)."""
        if not self._free:   # every running request fits: the engine holds at most max_num_seqs
            raise RuntimeError("mtpkit: no free slot in the generation controls' tables (this is a bug)")
        s = self._free.pop()
        p = r.params
        self.counts[s].zero_()
        self.prompt_seen[s].zero_()
        self.static[s].zero_()
        self.stop[s].zero_()
        if _penalized(p) and r.prompt_token_ids:
            self.prompt_seen[s, self._ids(r.prompt_token_ids)] = True
        words = [list(w) for w in (p.bad_words or [])]
        singles = [w[0] for w in words if len(w) == 1]
        if p.logit_bias:
            self.static[s, self._ids(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()), dtype=self.dtype,
                                                                   device=self.device)
        if p.allowed_token_ids is not None:
            keep = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
            keep[self._ids(p.allowed_token_ids)] = True
            self.static[s].masked_fill_(~keep, float("-inf"))
        if singles:
            self.static[s, self._ids(singles)] = float("-inf")
        if p.min_tokens > 0:
            self.stop[s, self._ids(set(r.eos_token_ids) | set(p.stop_token_ids))] = True
        return ControlState(self, s, _penalized(p), [w for w in words if len(w) > 1])

    def prepare(self, reqs: Sequence[ControlledRequest]) -> ControlInputs:
        """The step's per-row inputs, after building the slots of requests new to the controls
        and counting every penalised request's output tokens emitted since its last step: one
        scatter for the batch. O(rows + their new tokens) host work."""
        n = len(reqs)
        ints, floats = [[z] * n for z in NEUTRAL_INTS], [[z] * n for z in NEUTRAL_FLOATS]
        flat = []
        for i, r in enumerate(reqs):
            p = r.params
            if not p.has_controls:
                continue
            st = r.controls
            if st is None or st.tables is not self or not st.slot or st.num_counted > len(r.output_token_ids):
                if st is not None:
                    st.release()
                st = r.controls = self.build(r)
            if st.penalized and st.num_counted < len(r.output_token_ids):
                base = st.slot * self.vocab
                flat += [base + t for t in r.output_token_ids[st.num_counted:]]
            st.num_counted = len(r.output_token_ids)
            ints[0][i], ints[1][i], ints[2][i] = st.slot, 1, max(p.min_tokens - len(r.output_token_ids), 0)
            floats[0][i], floats[1][i], floats[2][i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        if flat:
            if self._counts_host is not None:
                counts = self._counts_host
                if len(flat) <= 64:   # a step's few tokens: np.add.at costs ~40 us a call whatever its size
                    for t in flat:
                        counts[t] += 1
                else:                 # (a preempted request's whole output, counted again)
                    np.add.at(counts, flat, 1)
            else:
                self.counts.view(-1).index_add_(0, self._ids(flat), torch.ones(len(flat), dtype=self.dtype,
                                                                             device=self.device))
        return ControlInputs(ints, floats, self.dtype, self.device)


@checked
def cumulative_draft_counts(drafts: Int[Tensor, "num_reqs num_spec"], bundle: int, vocab: int,
                            dtype: torch.dtype) -> Float[Tensor, "num_reqs bundle vocab"]:
    """[row, j, t]: how often t occurs among the row's drafts d_1..d_j (those before position j)."""
    onehot = torch.zeros(drafts.shape[0], bundle, vocab, dtype=dtype, device=drafts.device)
    if bundle > 1:
        onehot[:, 1:].scatter_(-1, drafts[:, :bundle - 1, None], 1.0)
    return onehot.cumsum(1)


@checked
def apply_controls(
    logits: Float[Tensor, "num_reqs bundle vocab"], drafts: Int[Tensor, "num_reqs bundle-1"],
    ints: Int[Tensor, "3 num_reqs"], floats: Float[Tensor, "3 num_reqs"],
    counts: Float[Tensor, "control_slots vocab"], prompt_seen: Bool[Tensor, "control_slots vocab"],
    static: Float[Tensor, "control_slots vocab"], stop: Bool[Tensor, "control_slots vocab"],
) -> Float[Tensor, "num_reqs bundle vocab"]:
    """The graph-safe controls (module docstring): a new tensor in the tables' dtype (fp32,
    float64 for a float64 model); rows whose `active` is off are the input's, unchanged. Only
    tensor ops of fixed shapes, so a trace or a CUDA graph records it as the eager call runs it."""
    _, B, V = logits.shape
    dtype = counts.dtype
    slots, active, min_left = ints[0], ints[1] > 0, ints[2]
    repetition, presence, frequency = floats[0], floats[1], floats[2]
    x = logits.to(dtype)
    cnt = counts[slots][:, None, :] + cumulative_draft_counts(drafts, B, V, dtype)     # [R, B, V]
    seen = prompt_seen[slots][:, None, :] | (cnt > 0)
    y = x + static[slots][:, None, :]
    # A neutral row (penalty 1, 0, 0) divides by 1, multiplies by 1 and subtracts 0: exact.
    rep = torch.where(seen, repetition[:, None, None], torch.ones((), dtype=dtype, device=x.device))
    y = torch.where(y > 0, y / rep, y * rep)
    y = y - frequency[:, None, None] * cnt - presence[:, None, None] * (cnt > 0).to(dtype)
    pos = torch.arange(B, device=x.device)
    y = y.masked_fill(stop[slots][:, None, :] & (pos[None, :] < min_left[:, None])[:, :, None], float("-inf"))
    return torch.where(active[:, None, None], y, x)


def _word_bans(r: ControlledRequest, words: list[list[int]], drafts: list[int], bundle: int
               ) -> list[tuple[int, int]]:
    """(bundle position, token) pairs the multi-token bad words ban for this row: those whose
    prefix ends the output (with the drafts before the position)."""
    out = []
    longest = max(len(w) for w in words)
    ctx = r.output_token_ids[-(longest - 1):] + drafts[:bundle - 1]
    base = len(ctx) - len(drafts[:bundle - 1])       # ctx[:base + j]: what precedes position j
    for j in range(bundle):
        end = base + j
        for w in words:
            m = len(w) - 1
            if end >= m and ctx[end - m:end] == w[:-1]:
                out.append((j, w[-1]))
    return out


def ban_bad_words(x: Float[Tensor, "num_reqs bundle vocab"], reqs: Sequence[ControlledRequest]
                  ) -> Float[Tensor, "num_reqs bundle vocab"]:
    """The multi-token bad words' bans, in place (eager: how many there are depends on the tokens)."""
    B = x.shape[1]
    banned = []
    for i, r in enumerate(reqs):
        st = r.controls
        if r.params.has_controls and st is not None and st.multi_words:
            banned.extend((i, j, t) for j, t in _word_bans(r, st.multi_words, r.drafts, B))
    if banned:
        i_, j_, t_ = torch.tensor(banned, dtype=torch.int64, device=x.device).unbind(1)
        x[i_, j_, t_] = float("-inf")
    return x


def controls_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The controls' arithmetic: fp32 at least (float64 for a float64 model)."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def controlled_logits(
    logits: Float[Tensor, "num_reqs bundle vocab"],
    drafts: Int[Tensor, "num_reqs bundle-1"],
    reqs: Sequence[ControlledRequest],
    tables: "ControlTables | Callable[[], ControlTables]",
    apply: Callable[[ControlInputs], Tensor] | None = None,
) -> Float[Tensor, "num_reqs bundle vocab"]:
    """The processed logits of a step (module docstring). `drafts[i]` are the tokens row i feeds
    after its last output token (d_1..d_k; none after a prefill). The same tensor when no row
    uses a control; else a new one (fp32 at least), the rows without controls unchanged.
    `tables` (or a function making them when first needed); `apply(inputs)`: apply_controls as
    captured / traced for this step (graphs/captured.py), None: called here on these tensors."""
    if not any(r.params.has_controls for r in reqs):
        return logits
    if callable(tables) and not isinstance(tables, ControlTables):
        tables = tables()
    inputs = tables.prepare(reqs)
    if apply is None:
        out = apply_controls(logits, drafts, *inputs.tensors(), *tables.tensors())
    else:
        out = apply(inputs)
    return ban_bad_words(out, reqs)


def dead_end_problem(params: SamplingParams, structured: bool) -> str:
    """What to name when the controls (and a grammar) left no token at a position."""
    names = [n for n, on in (("allowed_token_ids", params.allowed_token_ids is not None),
                             ("bad_words", bool(params.bad_words)), ("min_tokens", params.min_tokens > 0),
                             ("logit_bias", bool(params.logit_bias)), ("structured_outputs", structured)) if on]
    return ", ".join(names) or "the controls"
