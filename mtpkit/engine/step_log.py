"""What each engine step did, kept for the last `maxlen` steps: which requests it advanced and
how many tokens it emitted. It is how tests assert that concurrent callers' requests were
batched together, and what the server's /metrics reads (tokens/s, steps)."""

import collections
import threading
import time
from typing import NamedTuple


class StepRecord(NamedTuple):   # (a tuple: one is made every step, a frozen dataclass costs more host time)
    index: int                   # steps run before this one, by this engine
    kind: str                    # "prefill" or "verify" (the scheduler's StepKind)
    request_ids: tuple[int, ...]  # the requests the step advanced, in the plan's order
    num_tokens: int              # output tokens the step emitted (accepted drafts and the target's)
    start: float                 # time.monotonic() when it began
    end: float


class StepLog:
    """The last `maxlen` StepRecords (a bounded deque: a long-running server keeps a window),
    and totals over the engine's life."""

    def __init__(self, maxlen: int = 4096):
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()   # readers (metrics) iterate while a step appends
        self.num_steps = 0
        self.num_tokens = 0

    def record(self, kind: str, request_ids: tuple[int, ...], num_tokens: int, start: float) -> None:
        with self._lock:
            self._records.append(StepRecord(self.num_steps, kind, request_ids, num_tokens, start, time.monotonic()))
            self.num_steps += 1
            self.num_tokens += num_tokens

    def records(self) -> list[StepRecord]:
        """A copy of the kept records, oldest first."""
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Output tokens per second of wall time over the steps that ended in the last `window`
        seconds (0 when none did)."""
        now = time.monotonic()
        recent = [r for r in self.records() if r.end >= now - window]
        if not recent:
            return 0.0
        span = max(now - min(r.start for r in recent), 1e-9)
        return sum(r.num_tokens for r in recent) / span
