"""The speculative-decoding loop of a Gemma 4 target and its assistant, simulated with the
training models (training/gemma4_target.py, training/gemma4_assistant.py: both checked
against transformers) to measure acceptance; batched over prompts, each at its own length.

One round for a request whose committed tokens are c_0..c_n (c_n the newest, at position n):
the assistant drafts d_1..d_k from the committed context only (the target's KV at 0..n-1
and its hidden state at n-1, as a clean drafter does after any round); the target verifies
[c_n, d_1..d_k] (here: one forward over the whole sequence, without a cache, so nothing
stale is ever read). Drafts are one-hot (argmax):
- greedy target: d_j is accepted while it equals the target's argmax; then the target's
  token follows (the bonus);
- sampling at temperature T: d_j is accepted with probability p_T(d_j) (p_T: the target's
  tempered distribution after the accepted prefix); a rejected draft is replaced by a draw
  from p_T without d_j (renormalised), and after k accepted drafts a bonus token is drawn.
  The expected number of accepted drafts, sum_j prod_{i<=j} p_T(d_i), is recorded for every
  round (the figure reported: less noisy than the sampled outcome, also recorded), while the
  sampled outcome decides the text the next round drafts from.
A request near the end drafts only what fits (min(k, tokens still to make - 1)), as the
engine's draft limit does. The first token comes from the prefill, not from a round.
"""

import dataclasses

import torch

from mtpkit.models.gemma4.model import Gemma4ForCausalLM
from training.gemma4_assistant import AssistantModel, TargetKV, round_mask
from training.gemma4_target import fresh_cache, prefill_step
from mtpkit.models.gemma4.config import FULL, SLIDING


@dataclasses.dataclass
class Acceptance:
    """Per-round acceptance, as mtpkit's SpecStats defines it (floats: expected counts)."""
    num_spec: int
    rounds: int = 0
    accepted: float = 0.0
    sampled_accepted: int = 0
    accepted_per_position: list = dataclasses.field(default_factory=list)
    drafted_per_position: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = [0.0] * self.num_spec
        self.drafted_per_position = [0] * self.num_spec

    def record(self, drafted: int, expected_per_position: list[float], sampled: int) -> None:
        self.rounds += 1
        self.accepted += sum(expected_per_position)
        self.sampled_accepted += sampled
        for j in range(drafted):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += expected_per_position[j]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.rounds

    @property
    def sampled_mean_acceptance_length(self) -> float:
        return 1.0 + self.sampled_accepted / self.rounds

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


@torch.no_grad()
def forward(target: Gemma4ForCausalLM, seqs: list[list[int]]):
    """One prefill of every sequence (request i in block i + 1, blocks as long as the longest):
    (hidden [total, H], logits [total, V], cache, each sequence's first row in them, block size)."""
    L = max(map(len, seqs))
    cache = fresh_cache(target, len(seqs), L)
    ids, pos, meta = prefill_step(cache, seqs)
    hidden = target(ids, pos, meta, cache)
    starts = [0]
    for s in seqs[:-1]:
        starts.append(starts[-1] + len(s))
    return hidden, target.compute_logits(hidden), cache, starts, L


@torch.no_grad()
def draft(asst: AssistantModel, target: Gemma4ForCausalLM, hidden, cache, starts, L: int, rows: list[int],
          last: list[int], positions: list[int], k: int) -> list[list[int]]:
    """k greedy drafts per request: round at position positions[i] (the newest token last[i]),
    from row rows[i] of the forward whose KV and hidden states cover positions 0..positions[i]-1."""
    B = len(last)
    p = torch.tensor(positions)[:, None]
    h = torch.stack([hidden[starts[r] + n - 1] for r, n in zip(rows, positions)])[:, None]
    kv = TargetKV(target, cache, len(starts))
    kv.kv = {kind: (kk[rows], vv[rows]) for kind, (kk, vv) in kv.kv.items()}
    masks = {FULL: round_mask(p, L, None), SLIDING: round_mask(p, L, kv.window)}
    tok, out = torch.tensor(last), []
    for _ in range(k):
        d, h = asst.step(target.embed(tok).view(B, 1, -1), h, p, kv, masks)
        tok = asst.draft_logits(d)[:, 0].argmax(-1)
        out.append(tok)
    return torch.stack(out, 1).tolist() if k else [[] for _ in range(B)]


@torch.no_grad()
def speculate(target: Gemma4ForCausalLM, asst: AssistantModel | None, prompts: list[list[int]], new_tokens: int,
              num_spec: int, temperature: float = 0.0, seed: int = 0) -> tuple[list[list[int]], Acceptance]:
    """Generate new_tokens per prompt through the speculative loop; (generated tokens,
    acceptance). num_spec 0 (or no assistant) is plain decoding, one token per forward."""
    g = torch.Generator().manual_seed(seed)
    stats = Acceptance(max(num_spec, 1))

    def pick(logits_row: torch.Tensor, exclude: int | None = None) -> int:
        if temperature == 0:
            return int(logits_row.argmax())
        probs = torch.softmax(logits_row.double() / temperature, -1)
        if exclude is not None:
            probs[exclude] = 0.0
        return int(torch.multinomial(probs / probs.sum(), 1, generator=g))

    seqs = [list(p) for p in prompts]
    hidden, logits, cache, starts, L = forward(target, seqs)
    for i, s in enumerate(seqs):
        s.append(pick(logits[starts[i] + len(s) - 1]))
    todo = list(range(len(seqs)))
    row_of = {i: i for i in todo}       # request -> its row in the last forward
    while True:
        todo = [i for i in todo if len(seqs[i]) - len(prompts[i]) < new_tokens]
        if not todo:
            break
        ks = [min(num_spec, new_tokens - (len(seqs[i]) - len(prompts[i])) - 1) if asst is not None else 0
              for i in todo]
        k = max(ks)
        drafts = draft(asst, target, hidden, cache, starts, L, [row_of[i] for i in todo],
                       [seqs[i][-1] for i in todo], [len(seqs[i]) - 1 for i in todo], k) if k else [[]] * len(todo)
        cand = [seqs[i] + drafts[j][:ks[j]] for j, i in enumerate(todo)]
        hidden, logits, cache, starts, L = forward(target, cand)
        for j, i in enumerate(todo):
            n, d = len(seqs[i]) - 1, drafts[j][:ks[j]]
            rows = logits[starts[j] + n:starts[j] + n + len(d) + 1]           # distributions of n+1 .. n+len(d)+1
            expected, alive, accepted, token = [], 1.0, None, None
            for t, dt in enumerate(d):
                if temperature == 0:
                    alive *= float(int(rows[t].argmax()) == dt)
                else:
                    alive *= float(torch.softmax(rows[t].double() / temperature, -1)[dt])
                expected.append(alive)
            for t, dt in enumerate(d):          # the sampled outcome (greedy: the same)
                if temperature == 0:
                    ok = int(rows[t].argmax()) == dt
                else:
                    pt = float(torch.softmax(rows[t].double() / temperature, -1)[dt])
                    ok = float(torch.rand((), generator=g, dtype=torch.float64)) < pt
                if not ok:
                    accepted, token = t, pick(rows[t], exclude=dt)
                    break
            if accepted is None:
                accepted, token = len(d), pick(rows[len(d)])
            if asst is not None:
                stats.record(len(d), expected + [0.0] * (stats.num_spec - len(expected)), accepted)
            seqs[i] += d[:accepted] + [token]
        # The next round of request i reads this forward: its committed tokens are a prefix of
        # cand[j] up to the bonus token, whose KV it does not read.
        row_of = {i: j for j, i in enumerate(todo)}
    return [s[len(p):len(p) + new_tokens] for s, p in zip(seqs, prompts)], stats
