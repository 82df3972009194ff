"""A request's host-side state, and what the user gets back."""

import dataclasses
import enum

from mtpkit.display import HTMLRepr
from mtpkit.engine.prefix_cache import PrefixCacheStats
from mtpkit.sampling.controls import ControlState
from mtpkit.sampling.params import SamplingParams
from mtpkit.structured.matcher import RequestGrammar
from mtpkit.text.stop_strings import StopStringMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class SpecStats(HTMLRepr):
    """Speculation counters; mean acceptance length = tokens emitted per verify step."""

    num_spec: int = 0
    verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    # Drafts that could be accepted at each position (fewer than verify steps near
    # max_tokens / max_model_len, where a request drafts only what fits).
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    # LLM.stats: the prefix cache's counters when read (None: caching off); not merged
    prefix_cache: PrefixCacheStats | None = dataclasses.field(default=None, compare=False)

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        for counts in (self.accepted_per_position, self.drafted_per_position):
            counts += [0] * (self.num_spec - len(counts))
        for j in range(drafted):
            self.drafted_per_position[j] += 1
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_spec = max(self.num_spec, other.num_spec)
        self.verify_steps += other.verify_steps
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        for name in ("accepted_per_position", "drafted_per_position"):
            a, b = getattr(self, name), getattr(other, name)
            n = max(len(a), len(b))
            setattr(self, name, [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))])

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted drafts per verify step (num_spec + 1 when everything is accepted)."""
        return 1.0 + self.num_accepted / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Of the drafts made at position j (0-based), the fraction accepted."""
        acc = self.accepted_per_position + [0] * (self.num_spec - len(self.accepted_per_position))
        dra = self.drafted_per_position + [0] * (self.num_spec - len(self.drafted_per_position))
        return [a / d if d else 0.0 for a, d in zip(acc, dra)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    html_kind = "spec_stats"   # Jupyter: acceptance per position as a bar chart

    def __str__(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
        return (f"mean acceptance length {self.mean_acceptance_length:.2f} "
                f"({self.num_accepted}/{self.num_drafted} drafts accepted; per position [{rates}])"
                + (f"; {self.prefix_cache}" if self.prefix_cache is not None else ""))


# eq=False: a request is an identity (mutable engine state), compared and hashed by identity. The
# generated __eq__ built a tuple of every field per comparison, and the scheduler's and stream's
# membership tests made that quadratic in the requests of a call (12 s of 17 for 1,200 requests).
@dataclasses.dataclass(eq=False)
class Request:
    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    seed: int | None               # sampling seed of a random request (its own or derived); None: greedy
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0          # tokens whose KV and recurrent state are in the caches
    prefill_target: int = 0        # tokens to prefill (prompt + outputs when recomputed)
    block_tables: list = dataclasses.field(default_factory=list)   # kv_pools.BlockTable per KV pool
    state_slots: list[int] | None = None
    prev_num_emitted: int = 1      # tokens the previous step emitted (a >= 1): selects the state to read
    drafts: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None           # why it ended with finish_reason "error"
    num_preemptions: int = 0
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    stop_matcher: StopStringMatcher | None = None   # when params.stop is set
    # Where each output token came from (parallel to output_token_ids): the request's step
    # that emitted it, and its draft position (0: the target's own token).
    num_steps: int = 0             # steps that emitted tokens to this request
    token_steps: list[int] = dataclasses.field(default_factory=list)
    token_draft_positions: list[int] = dataclasses.field(default_factory=list)
    # When asked (params.logprobs / prompt_logprobs): one {token: Logprob} per output token,
    # kept in step with output_token_ids (scheduler._append); and None for the first prompt
    # token then one per prompt token, appended as the prefill reaches them (a recompute after
    # preemption does not append them again).
    output_logprobs: list | None = None
    prompt_logprobs: list | None = None
    # params.structured_outputs: the request's matcher (it has consumed output_token_ids)
    grammar: RequestGrammar | None = None
    # SamplingParams.n > 1: this request is sample `sample_index` of `samples` (all n, in
    # order, each a request of its own id). The prompt is prefilled once, by sample 0 up to
    # position fork_at (its last token); then `forks` (the samples not started yet) take
    # copies of its block tables (shared blocks, copy-on-write) and of its state, in the slots
    # it holds for them (`fork_slots`), and each prefills the last token itself.
    sample_index: int = 0
    samples: list | None = dataclasses.field(default=None, repr=False)
    forks: list = dataclasses.field(default_factory=list, repr=False)
    fork_at: int = 0
    fork_slots: list = dataclasses.field(default_factory=list)
    # The generation controls' device state (token counts, bias row): built at the request's
    # first step that uses them, dropped on preemption and rebuilt from the tokens.
    controls: ControlState | None = dataclasses.field(default=None, repr=False)
    # Prefix caching (engine/prefix_cache.py): the keys of its blocks so far, how many of its
    # blocks are keyed (the hit's, then each one its steps complete), the prompt tokens its
    # first admission took from the cache, its newest decode-time state snapshot, and where
    # its prompt leaves the cached KV (a snapshot is written there: the requests after it
    # that share the same prefix resume at that point, not at an interval boundary before it).
    block_keys: list = dataclasses.field(default_factory=list, repr=False)
    num_keyed: int = 0
    num_cached_tokens: int = 0
    decode_snapshot: int | None = None
    kv_match_end: int = 0
    # Without generation controls or logprobs (greedy or random): its tokens are a graph's outcome
    # alone, which decode runs feed to their next step inside the graph (num_scheduler_steps).
    plain: bool = dataclasses.field(init=False, default=False)
    # ... and greedy: a verify step whose rows all are (and none has a grammar) takes the verify
    # graph's greedy outcome as it is (engine/runner.py).
    plain_greedy: bool = dataclasses.field(init=False, default=False)

    def __post_init__(self):
        p = self.params
        self.plain = not p.has_controls and p.logprobs is None
        self.plain_greedy = self.plain and p.temperature == 0
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """all_token_ids[-1], without building the whole sequence (a verify step's first input)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def tokens_from(self, start: int) -> list[int]:
        """all_token_ids[start:], without building the part before it."""
        p = len(self.prompt_token_ids)
        return self.output_token_ids[start - p:] if start >= p else self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    def remaining(self, max_model_len: int) -> int:
        """Tokens this request may still emit."""
        return min(self.params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens)


@dataclasses.dataclass
class CompletionOutput:
    """One of a prompt's n samples (vLLM's CompletionOutput, with mtpkit's speculation
    fields): `index` is the sample's place in RequestOutput.outputs, `request_id` its own id
    (LLM.abort of it stops this sample only)."""

    index: int
    request_id: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    spec_stats: SpecStats
    logprobs: list | None = None
    error: str | None = None
    num_preemptions: int = 0
    token_steps: list[int] = dataclasses.field(default_factory=list)
    token_draft_positions: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)
class RequestOutput(HTMLRepr):
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None        # "length", "stop", "error", "abort" (LLM.abort, an interrupted call)
    spec_stats: SpecStats
    error: str | None = None
    num_preemptions: int = 0
    # Per token of token_ids: the request's step that emitted it (0: the step that finished
    # the prompt; each later step is one verify step, or a recompute after preemption) ...
    token_steps: list[int] = dataclasses.field(default_factory=list)
    # ... and its origin: j >= 1 for an accepted draft of position j, 0 for the target's own
    # token (after a prefill, at a rejection, or the bonus token after all drafts were accepted).
    token_draft_positions: list[int] = dataclasses.field(default_factory=list)
    # For the HTML display (each token's text); not part of the result's value.
    tokenizer: object = dataclasses.field(default=None, repr=False, compare=False)
    # SamplingParams.logprobs: one {token_id: Logprob} per token of token_ids (the token and the
    # top-N); None when not asked. prompt_logprobs: None for the first prompt token, then one
    # such dict per prompt token (its logprob given the tokens before it).
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # The prompt's samples (SamplingParams.n of them), in order; the fields above are those of
    # outputs[0]. Built from the fields above when not given (n = 1).
    outputs: list[CompletionOutput] = dataclasses.field(default_factory=list)
    # Prompt tokens taken from the prefix cache at the request's first admission (vLLM's name)
    num_cached_tokens: int = 0

    def __post_init__(self):
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.request_id, self.token_ids, self.text, self.finish_reason,
                                             self.spec_stats, self.logprobs, self.error, self.num_preemptions,
                                             self.token_steps, self.token_draft_positions)]

    @property
    def finished(self) -> bool:
        """Every sample has finished (finish_reason stands for outputs[0]'s)."""
        return self.finish_reason is not None and all(o.finish_reason is not None for o in self.outputs[1:])

    @property
    def num_accepted_tokens(self) -> int:
        """Accepted drafts among token_ids (spec_stats.num_accepted also counts drafts accepted
        past a stop token, which are dropped)."""
        return sum(1 for j in self.token_draft_positions if j)

    html_kind = "request_output"   # Jupyter: the text with every token coloured by origin
