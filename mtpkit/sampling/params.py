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
    # Generation controls (vLLM's / OpenAI's names; mtpkit.sampling.controls), each applied at
    # every bundle position of a verify step as if the tokens came one at a time.
    # repetition_penalty (HF / vLLM): over prompt and output tokens, a seen token's logit is
    # divided by it when > 0, multiplied when < 0 (1: off). presence_penalty /
    # frequency_penalty (OpenAI): over output tokens, logit - presence * (count > 0) -
    # frequency * count (0: off). min_p: after temperature, drop tokens with p < min_p * max p
    # (0: off; random rows only). logit_bias: token id -> added to its logit.
    # allowed_token_ids: only these may be generated (None: all). bad_words: token-id
    # sequences that may not be generated (a sequence's last token is banned after its other
    # tokens were just generated; one token: always banned); LLM also takes strings, encoded
    # by its tokenizer. min_tokens: eos and stop_token_ids are banned until that many output
    # tokens exist.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list | None = None
    min_tokens: int = 0

    @property
    def has_controls(self) -> bool:
        """Whether any logits control is on (a row without one takes the plain path)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)
                or self.min_tokens > 0)

    def validate(self, vocab_size: int | None = None, eos_token_ids=()) -> None:
        """Raise InputError naming the bad field and its valid range (`eos_token_ids`: the
        checkpoint's, which min_tokens bans too)."""
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
        problems += _control_problems(self, vocab_size, tuple(eos_token_ids))
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


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_id(t, vocab_size: int | None) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab_size is None or t < vocab_size)


def _control_problems(p: SamplingParams, vocab_size: int | None, eos_token_ids: tuple = ()) -> list[str]:
    """The generation controls' problems (ranges as vLLM / OpenAI state them), and the
    combinations that ban every token at the first position whatever is generated (the ones
    that can only arise from the tokens end the request at run time: engine/runner.py)."""
    problems = []
    ids = f"token ids in 0..{vocab_size - 1}" if vocab_size is not None else "token ids >= 0"
    if not _is_number(p.repetition_penalty) or p.repetition_penalty <= 0:
        problems.append(f"repetition_penalty={p.repetition_penalty!r} must be a finite number > 0 (1 = off)")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_number(v) or not -2.0 <= v <= 2.0:
            problems.append(f"{name}={v!r} must be a number in [-2, 2] (0 = off)")
    if not _is_number(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        problems.append(f"min_p={p.min_p!r} must be a number in [0, 1] (0 = off)")
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            problems.append(f"logit_bias={p.logit_bias!r} must be a dict {{token id: bias}}")
        else:
            bad = [t for t in p.logit_bias if not _is_id(t, vocab_size)]
            if bad:
                problems.append(f"logit_bias keys {bad[:8]} are not {ids}")
            vals = [v for v in p.logit_bias.values() if not _is_number(v) or not -100 <= v <= 100]
            if vals:
                # OpenAI's range; -100 already bans a token, and a value past fp32's range would
                # make every logit infinite (use allowed_token_ids / bad_words to ban tokens)
                problems.append(f"logit_bias values {vals[:8]} must be finite numbers in [-100, 100] (OpenAI's "
                                "range; -100 bans a token in effect)")
    if p.allowed_token_ids is not None:
        if not isinstance(p.allowed_token_ids, list) or not p.allowed_token_ids:
            problems.append(f"allowed_token_ids={p.allowed_token_ids!r} must be None or a non-empty list of "
                            "token ids")
        elif bad := [t for t in p.allowed_token_ids if not _is_id(t, vocab_size)]:
            problems.append(f"allowed_token_ids {bad[:8]} are not {ids}")
        else:
            problems += _first_token_problems(p, eos_token_ids)
    if p.bad_words is not None:
        words = p.bad_words if isinstance(p.bad_words, list) else None
        if words is None or not all(isinstance(w, (list, str)) and w for w in words):
            problems.append(f"bad_words={p.bad_words!r} must be a list of non-empty token-id lists (or, "
                            "through LLM, strings)")
        else:
            bad = [w for w in words if isinstance(w, list) and not all(_is_id(t, vocab_size) for t in w)]
            if bad:
                problems.append(f"bad_words {bad[:4]} hold values that are not {ids}")
    if not isinstance(p.min_tokens, int) or isinstance(p.min_tokens, bool) or p.min_tokens < 0:
        problems.append(f"min_tokens={p.min_tokens!r} must be an int >= 0")
    elif isinstance(p.max_tokens, int) and p.min_tokens > p.max_tokens:
        problems.append(f"min_tokens={p.min_tokens} exceeds max_tokens={p.max_tokens}; lower it or raise max_tokens")
    return problems


def _first_token_problems(p: SamplingParams, eos_token_ids: tuple) -> list[str]:
    """allowed_token_ids all banned at the first output position: by one-token bad_words always,
    with min_tokens also by the stop ids it bans (stop_token_ids and eos) until then."""
    singles = {w[0] for w in p.bad_words if isinstance(w, list) and len(w) == 1} if isinstance(
        p.bad_words, list) else set()
    allowed = set(p.allowed_token_ids)
    if allowed <= singles:
        return [("bad_words ban every one of allowed_token_ids: nothing could be generated; allow a token that no "
                 "one-token bad word bans")]
    min_tokens = p.min_tokens if isinstance(p.min_tokens, int) else 0
    eos = () if p.ignore_eos is True else eos_token_ids   # ignore_eos: eos is no stop id (Engine.add)
    stops = set(p.stop_token_ids if isinstance(p.stop_token_ids, list) else []) | set(eos)
    if min_tokens > 0 and allowed <= singles | stops:
        return [(f"min_tokens={min_tokens} bans the stop ids (stop_token_ids and eos {sorted(stops)[:8]}) until "
                 "then, and with bad_words they are every one of allowed_token_ids: nothing could be generated "
                 "first; allow a token that is not a stop id, or set min_tokens=0")]
    return []
