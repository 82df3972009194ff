"""SamplingParams: what a request asks of the sampler (names as vLLM's), validated before
anything is queued.
"""

import dataclasses
import math

from mtpkit.errors import InputError
from mtpkit.sampling.structured_outputs import StructuredOutputs

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest seed
LOGPROBS_MODES = ("raw", "processed")


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0              # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = dataclasses.field(default_factory=list)   # stop strings, excluded from the text
    # Logprobs (vLLM's names; mtpkit.sampling.logprobs): None = off; N: each generated token's
    # logprob and rank with the N likeliest tokens' (0: the token's alone). prompt_logprobs
    # likewise for every prompt token after the first (always raw). logprobs_mode "raw":
    # log_softmax of the model's logits; "processed": of the distribution the token was
    # sampled from (after temperature, top-k, top-p; a greedy row's are its raw ones).
    # Under speculation an accepted draft gets the target's logprobs at its position.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw"
    # Structured outputs (mtpkit.sampling.structured_outputs; compiled by mtpkit/structured/):
    # every token is masked to what the grammar allows, drafts included. "processed" logprobs
    # are then those of the masked distribution; "raw" ones stay the model's.
    structured_outputs: StructuredOutputs | None = None
    # n samples of the prompt (vLLM's name), returned in RequestOutput.outputs. The prompt is
    # prefilled once and its KV shared; sample i draws as a request of seed + i would (without
    # a seed, each sample gets its own fixed one from the engine's seed and its request id).
    n: int = 1

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
        if not isinstance(self.stop, list) or not all(isinstance(x, str) and x for x in self.stop):
            problems.append(f"stop={self.stop!r} must be a list of non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                problems.append(f"{name}={v!r} must be None or an int >= 0 (top tokens returned per position)")
            elif vocab_size is not None and v > vocab_size:
                problems.append(f"{name}={v} exceeds the vocabulary size {vocab_size}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            problems.append(f"n={self.n!r} must be an int >= 1 (samples per prompt)")
        elif self.n > 1 and isinstance(self.temperature, (int, float)) and self.temperature == 0:
            problems.append(f"n={self.n} with greedy decoding (temperature=0) would give {self.n} identical "
                            "samples; set temperature > 0 to sample, or n=1")
        if self.logprobs_mode not in LOGPROBS_MODES:
            problems.append(f"logprobs_mode={self.logprobs_mode!r} must be one of {', '.join(LOGPROBS_MODES)}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                problems.append(f"structured_outputs must be a mtpkit.StructuredOutputs, not "
                                f"{type(self.structured_outputs).__name__}")
            else:
                problems += self.structured_outputs.problems()
                if self.ignore_eos:
                    problems.append("ignore_eos=True cannot be combined with structured_outputs: a complete "
                                    "structure ends with eos; drop ignore_eos (max_tokens still caps the length)")
        if problems:
            raise InputError("invalid SamplingParams: " + "; ".join(problems))
