"""Sampling parameters, their per-step tensors, and the target distribution p.

Greedy rows (temperature 0) take the argmax; random rows apply temperature, then top-k, then
top-p, and draw with the request's own torch.Generator so a seeded request is reproducible
whatever else is in the batch.
"""

import dataclasses
import math

import torch

from .errors import InputError
from .shapes import Bool, Float, Int, Tensor, checked, shaped_dataclass

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest seed


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0              # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InputError naming the bad field and its valid range."""
        problems = []
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            problems.append(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            problems.append(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        elif vocab_size is not None and self.top_k > vocab_size:
            problems.append(f"top_k={self.top_k} exceeds the vocabulary size {vocab_size}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            problems.append(f"seed={self.seed!r} must be an int or None")
        elif self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            # torch.Generator.manual_seed takes 64 bits (a negative seed aliases seed + 2**64)
            problems.append(f"seed={self.seed} must be in 0..2**64-1")
        bad_stop = [t for t in self.stop_token_ids
                    if not isinstance(t, int) or (vocab_size is not None and not 0 <= t < vocab_size)]
        if bad_stop:
            problems.append(f"stop_token_ids {bad_stop} are not token ids in 0..{(vocab_size or 0) - 1}")
        if problems:
            raise InputError("invalid SamplingParams: " + "; ".join(problems))


@shaped_dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of one step (real rows only)."""

    temperature: Float[Tensor, "num_reqs"]
    top_k: Int[Tensor, "num_reqs"]
    top_p: Float[Tensor, "num_reqs"]
    greedy: Bool[Tensor, "num_reqs"]
    all_greedy: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device) -> "SamplingTensors":
        temps = [p.temperature for p in params]
        return cls(
            temperature=torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor([t == 0 for t in temps], dtype=torch.bool, device=device),
            all_greedy=all(t == 0 for t in temps),
        )


@checked
def target_probs(
    logits: Float[Tensor, "num_reqs bundle vocab"], st: SamplingTensors
) -> Float[Tensor, "num_reqs bundle vocab"]:
    """p: temperature, top-k, top-p applied per row (fp32). Greedy rows get a one-hot argmax."""
    x = logits.float() / st.temperature[:, None, None]
    V = x.shape[-1]
    if bool((st.top_k > 0).any()):
        k = torch.where(st.top_k > 0, st.top_k, V).clamp(max=V)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool((st.top_p < 1.0).any()):
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= st.top_p[:, None, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(st.greedy.any()):
        onehot = torch.nn.functional.one_hot(logits.argmax(-1), V).to(probs.dtype)
        probs = torch.where(st.greedy[:, None, None], onehot, probs)
    return probs


@checked
def sample_rows(probs: Float[Tensor, "num_reqs vocab"], generators: list) -> Int[Tensor, "num_reqs"]:
    """One draw per row of probs [n, vocab], each with its own generator."""
    return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(probs, generators)])
