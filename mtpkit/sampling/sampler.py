"""Sampling parameters, their per-step tensors, the target distribution p, and the draws.

Greedy rows (temperature 0) take the argmax; random rows apply temperature, then min-p, then
top-k, then top-p (`target_probs`; vLLM's order), and draw with an exponential race (`sample_tokens`): the token at a
position is argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. over the vocabulary. Since
P(E_i / p_i < E_j / p_j for all j != i) = p_i, that is exactly a sample from p (the
Gumbel-max trick: -log E_i is Gumbel).

The E are not drawn from a stream. They are a pure function of (request seed, absolute
position of the token being sampled, vocabulary index): a 64-bit key hashed from (seed,
position) with splitmix64, injective in the position for a given seed, then the splitmix64
sequence of that key over the vocabulary (`noise_keys`, `exponential_noise`). So a token's
randomness does not depend on how many draws came before it: a seeded request gives the same
tokens whatever else is in the batch, when it is preempted and recomputed, and however the
steps are scheduled; with speculation the drafts only decide how many of these tokens a step
emits (see sampling/rejection.py). The noise is integer arithmetic on tensors (the same
integers on every device), and a random row always costs the same: bundle * vocab values per
step, whatever is accepted.
(torch.Generator would not do: a CPU generator keeps only the low 32 bits of its seed.)
"""


from typing import NamedTuple

import torch

from mtpkit.shapes import Bool, Float, Int, Tensor, checked, shaped_dataclass
from mtpkit.sampling.params import SamplingParams


class Filters(NamedTuple):
    """Which parts of `target_probs` a step runs: min-p, top-k, top-p where some random row asks,
    the greedy rows' one-hot where a row is greedy. Decided on the host from the requests'
    settings (no tensor read); a captured step (graphs/captured.py) fixes them per graph. A row's
    p does not depend on them: each part leaves a row that does not ask unchanged, so a row samples
    the same tokens whatever the other rows of its batch ask."""

    min_p: bool
    top_k: bool
    top_p: bool
    greedy: bool

    @classmethod
    def of(cls, params: "list[SamplingParams]") -> "Filters":
        rand = [p for p in params if p.temperature != 0]
        return cls(any(p.min_p > 0 for p in rand), any(p.top_k > 0 for p in rand),
                   any(p.top_p < 1.0 for p in rand), len(rand) < len(params))

    def for_graph(self) -> "Filters":
        """The parts a compiled captured step (graphs/captured.py) runs for these: fewer variants of
        its sample graph to compile (seconds each). Min-p (a few elementwise ops, fused) and the
        one-hot (padded rows are greedy) always; top-k and top-p (a sort each) together where either
        is asked. A part run for rows that do not ask changes nothing for them."""
        truncate = self.top_k or self.top_p
        return Filters(True, truncate, truncate, True)

    def code(self) -> str:
        """A short name for graph names: the parts run, e.g. "kpg" (top-k, top-p, greedy)."""
        return "".join(c for c, on in zip("mkpg", self) if on) or "t"


@shaped_dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of one step (real rows; a captured step's padded rows are
    greedy: `from_buffers`)."""

    temperature: Float[Tensor, "num_reqs"]
    top_k: Int[Tensor, "num_reqs"]
    top_p: Float[Tensor, "num_reqs"]
    min_p: Float[Tensor, "num_reqs"]
    greedy: Bool[Tensor, "num_reqs"]
    all_greedy: bool
    filters: Filters

    @classmethod
    def from_params(cls, params: list[SamplingParams], device) -> "SamplingTensors":
        temps = [p.temperature for p in params]
        return cls(
            temperature=torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor([t == 0 for t in temps], dtype=torch.bool, device=device),
            all_greedy=all(t == 0 for t in temps),
            filters=Filters.of(params),
        )

    @classmethod
    def from_buffers(cls, floats: Float[Tensor, "3 num_reqs_padded"], ints: Int[Tensor, "3 num_reqs_padded"],
                     filters: Filters) -> "SamplingTensors":
        """The settings a captured step reads from its static buffers (`sampling_rows`' layout),
        without host reads: graph-safe. Its rows are then the graph size's, padded ones greedy
        (the fields' `num_reqs` are the rows the functions taking them run over)."""
        return cls(temperature=floats[0], top_k=ints[0], top_p=floats[1], min_p=floats[2], greedy=ints[1] != 0,
                   all_greedy=False, filters=filters)


# A captured step's sampling settings per row, as two static buffers: floats (temperature, with 1.0
# for greedy rows; top_p; min_p) and ints (top_k; 1 if greedy; the row's noise seed key,
# `seed_key`). What padded rows hold: greedy, every filter off.
NEUTRAL_SAMPLING_FLOATS, NEUTRAL_SAMPLING_INTS = (1.0, 1.0, 0.0), (0, 1, 0)


def sampling_rows(params: list[SamplingParams], seeds: list) -> tuple[list[list[float]], list[list[int]]]:
    """The buffers' values for these rows (`seeds[i]`: row i's seed, None if greedy), in plain Python."""
    floats = [[p.temperature if p.temperature > 0 else 1.0 for p in params], [p.top_p for p in params],
              [p.min_p for p in params]]
    ints = [[p.top_k for p in params], [int(p.temperature == 0) for p in params],
            [0 if s is None else seed_key(s) for s in seeds]]
    return floats, ints


@checked
def target_probs(
    logits: Float[Tensor, "num_reqs bundle vocab"], st: SamplingTensors
) -> Float[Tensor, "num_reqs bundle vocab"]:
    """p: temperature, min-p, top-k, top-p applied per row (fp32). Greedy rows get a one-hot argmax.
    Each part runs where `st.filters` says (a row that does not ask for it passes through unchanged)."""
    x = logits.float() / st.temperature[:, None, None]
    V = x.shape[-1]
    use = st.filters
    if use.min_p:
        # vLLM's min-p: after temperature, drop tokens whose p is below min_p * the largest p
        # (p / max p = exp(x - max x): no softmax needed)
        rel = (x - x.amax(-1, keepdim=True)).exp()
        x = x.masked_fill(rel < st.min_p[:, None, None], float("-inf"))
    if use.top_k:
        k = torch.where(st.top_k > 0, st.top_k, V).clamp(max=V)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if use.top_p:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= st.top_p[:, None, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        kept = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        # (rows with top_p 1 keep their p as it is: a cumulative sum can reach 1.0 early in rounding)
        probs = torch.where((st.top_p < 1.0)[:, None, None], kept / kept.sum(-1, keepdim=True), probs)
    if use.greedy:
        onehot = torch.nn.functional.one_hot(logits.argmax(-1), V).to(probs.dtype)
        probs = torch.where(st.greedy[:, None, None], onehot, probs)
    return probs


_MASK = (1 << 64) - 1
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix64(x: int) -> int:
    """splitmix64's output function of x + golden ratio (Python ints): a bijection of 64-bit
    integers. The tensor functions below compute the same, in int64 tensors."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK
    return x ^ (x >> 31)


def _signed(c: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


@checked
def _shr(z: Int[Tensor, "num_reqs bundle *vocab"], s: int) -> Int[Tensor, "num_reqs bundle *vocab"]:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return torch.bitwise_right_shift(z, s).bitwise_and_((1 << (64 - s)) - 1)


@checked
def _finalize_(z: Int[Tensor, "num_reqs bundle *vocab"]) -> Int[Tensor, "num_reqs bundle *vocab"]:
    """splitmix64's output function, in place (int64 arithmetic wraps modulo 2^64 in torch)."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_signed(_MUL1))
    z.bitwise_xor_(_shr(z, 27)).mul_(_signed(_MUL2))
    return z.bitwise_xor_(_shr(z, 31))


def seed_key(seed: int) -> int:
    """mix64(seed), as an int64 value: the part of a noise key the seed gives (`noise_keys`)."""
    return _signed(_mix64(seed & _MASK))


@checked
def noise_keys(seeds: list, positions: Int[Tensor, "num_reqs bundle"]) -> Int[Tensor, "num_reqs bundle"]:
    """The 64-bit key of (request seed, token position) for each row's positions:
    mix64(mix64(seed) ^ position). For one seed distinct positions get distinct keys (mix64 is
    a bijection); two pairs with different seeds share a key with probability 2^-64. Seeds
    are taken modulo 2^64."""
    base = torch.tensor([seed_key(s) for s in seeds], dtype=torch.int64).to(positions.device)
    return keyed_positions(base, positions)


@checked
def keyed_positions(seed_keys: Int[Tensor, "num_reqs"], positions: Int[Tensor, "num_reqs bundle"]
                    ) -> Int[Tensor, "num_reqs bundle"]:
    """`noise_keys` from the rows' `seed_key`s as a tensor (graph-safe: no host values)."""
    return _finalize_((seed_keys[:, None] ^ positions).add_(_signed(_GOLDEN)))


@checked
def noise_steps(vocab: int, device) -> Int[Tensor, "vocab"]:
    """(i + 1) * golden ratio for every vocabulary index i, modulo 2^64: a key's splitmix64 sequence
    is mix64 of key + these. A captured step takes them as an argument, made here once: inductor
    (CPU C++, torch 2.13) miscompiles an arange times a 64-bit constant inside a graph (wrong
    values, writes out of bounds)."""
    return torch.arange(1, vocab + 1, dtype=torch.int64, device=device).mul_(_signed(_GOLDEN))


@checked
def exponential_noise(keys: Int[Tensor, "num_reqs bundle"], vocab: int,
                      steps: Int[Tensor, "vocab"] | None = None) -> Float[Tensor, "num_reqs bundle vocab"]:
    """E ~ Exp(1) for every (row, position, token): element i of the splitmix64 sequence of the
    key, its top 53 bits as a uniform u in (0, 1), E = -log(u) in float64. In place where it
    can: it runs at vocabulary size. `steps`: noise_steps(vocab), if made already."""
    if steps is None:
        steps = noise_steps(vocab, keys.device)
    z = _finalize_(keys[..., None] + steps)
    return _shr(z, 11).double().add_(0.5).mul_(2.0 ** -53).log_().neg_()


@checked
def sample_tokens(
    probs: Float[Tensor, "num_reqs bundle vocab"], seeds: list, positions: list
) -> Int[Tensor, "num_reqs bundle"]:
    """The token at each (row, bundle index j): argmax_i p_i / E_i, with the E of (seeds[row],
    positions[row] + j). A fixed number of values per row, whatever is accepted later."""
    R, B, V = probs.shape
    pos = torch.tensor(positions, dtype=torch.int64).to(probs.device)[:, None] + torch.arange(B, device=probs.device)
    return race(probs, noise_keys(seeds, pos))


@checked
def race(probs: Float[Tensor, "num_reqs bundle vocab"], keys: Int[Tensor, "num_reqs bundle"],
         steps: Int[Tensor, "vocab"] | None = None) -> Int[Tensor, "num_reqs bundle"]:
    """argmax_i p_i / E_i with the E of each (row, position)'s noise key: the draw itself
    (`steps`: exponential_noise's)."""
    return exponential_noise(keys, probs.shape[-1], steps).reciprocal_().mul_(probs).argmax(-1)
