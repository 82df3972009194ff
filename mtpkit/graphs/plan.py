"""Which decode (verify) step sizes get CUDA graphs.

A verify step feeds every running request exactly ``bundle`` (EngineConfig.bundle) query tokens
(its last sampled token plus its drafts). Graphs are therefore keyed by the padded REQUEST
count, and a graph for ``n`` requests always holds ``n * bundle`` tokens: a capture batch
with a ragged last request (vLLM #25647, regression cases 1 and 8) cannot be expressed.
Users who think in vLLM's token-counted ``cudagraph_capture_sizes`` are checked here,
before any model work, and told the corrected list.
"""

import bisect
import dataclasses
import numbers
from collections.abc import Sequence

from mtpkit.config import MAX_NUM_SPEC, EngineConfig
from mtpkit.errors import ConfigError


def _bundle(num_spec: int) -> int:
    # The engine config's bundle (its one definition), not a second formula here.
    return EngineConfig(num_spec=num_spec).bundle


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a size or a count is always a mistake.
    # (a plain int first: an abstract class's isinstance is slow, and dispatch runs every step)
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    num_spec: int
    max_num_seqs: int
    sizes: tuple[int, ...]  # request counts, ascending, unique, last == max_num_seqs

    def __post_init__(self) -> None:
        # Re-check the invariants so a hand-built plan cannot be wrong either.
        s = tuple(self.sizes)
        object.__setattr__(self, "sizes", s)  # a list would make the frozen plan unhashable
        ok = (
            _is_int(self.num_spec)
            and 0 <= self.num_spec <= MAX_NUM_SPEC
            and len(s) > 0
            and all(_is_int(x) and x >= 1 for x in s)
            and all(a < b for a, b in zip(s, s[1:]))
            and _is_int(self.max_num_seqs)
            and s[-1] == self.max_num_seqs
        )
        if not ok:
            raise ConfigError(
                f"CapturePlan(num_spec={self.num_spec!r}, sizes={list(s)}) needs num_spec in "
                f"0..{MAX_NUM_SPEC} and sizes that are request counts >= 1, strictly "
                f"ascending, ending at max_num_seqs={self.max_num_seqs}; "
                f"use build_capture_plan() to make one"
            )

    @property
    def bundle(self) -> int:
        return _bundle(self.num_spec)

    @property
    def token_sizes(self) -> tuple[int, ...]:
        return tuple(n * self.bundle for n in self.sizes)

    def dispatch(self, num_reqs: int) -> int:
        """The graph (num_reqs_padded) a decode step with ``num_reqs`` requests replays."""
        if not _is_int(num_reqs) or not 1 <= num_reqs <= self.max_num_seqs:
            raise ConfigError(
                f"num_reqs={num_reqs!r} is outside 1..max_num_seqs={self.max_num_seqs}; "
                f"the scheduler must never build a larger decode batch"
            )
        # The last size is max_num_seqs, so a size >= num_reqs always exists.
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    def capture_order(self) -> tuple[int, ...]:
        # Largest first: the shared graph memory pool is sized by the first capture and
        # the smaller graphs then reuse it instead of growing it.
        return tuple(reversed(self.sizes))

    def describe(self) -> str:
        reqs = ",".join(map(str, self.sizes))
        toks = ",".join(map(str, self.token_sizes))
        return f"num_spec={self.num_spec} bundle={self.bundle}: graphs for {reqs} requests ({toks} tokens)"


def _check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name}={value!r} must be an int {bound}")
    return int(value)


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs, always ending at max_num_seqs."""
    max_num_seqs = _check_count("max_num_seqs", max_num_seqs, 1)
    sizes = [n for n in (1, 2, 4, 8) if n <= max_num_seqs]
    sizes += range(16, max_num_seqs + 1, 8)
    return sorted(set(sizes) | {max_num_seqs})


def _check_sizes(name: str, sizes: object) -> list[int]:
    """A non-empty list of positive ints, or ConfigError naming the bad entries."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ConfigError(f"{name} must be a list of positive ints, got {sizes!r}")
    if len(sizes) == 0:
        raise ConfigError(f"{name} is empty; give at least one size or leave it unset for the defaults")
    bad = [s for s in sizes if not _is_int(s) or s < 1]
    if bad:
        raise ConfigError(f"{name} {list(sizes)} has entries that are not positive ints: {bad}")
    return [int(s) for s in sizes]


def _complete(reqs: Sequence[int], max_num_seqs: int) -> list[int]:
    # Dedupe, sort, clip, and always include max_num_seqs: the widest batch must never
    # run eager (vLLM #54933, regression case 7).
    return sorted({n for n in reqs if n <= max_num_seqs} | {max_num_seqs})


def build_capture_plan(
    *,
    num_spec: int,
    max_num_seqs: int,
    max_state_reqs: int | None = None,
    graph_sizes: Sequence[int] | None = None,
    cudagraph_capture_sizes: Sequence[int] | None = None,
) -> CapturePlan:
    num_spec = _check_count("num_spec", num_spec, 0, MAX_NUM_SPEC)
    max_num_seqs = _check_count("max_num_seqs", max_num_seqs, 1)
    bundle = _bundle(num_spec)

    # A decode batch wider than the state-slot pool would only fail at capture (vLLM
    # #34094, regression case 4); say so now, with the number that fits.
    if max_state_reqs is not None:
        max_state_reqs = _check_count("max_state_reqs", max_state_reqs, 1)
        if max_num_seqs > max_state_reqs:
            raise ConfigError(
                f"max_num_seqs={max_num_seqs} but the state-slot pool holds {max_state_reqs} "
                f"requests (each request needs bundle={bundle} slots plus the null slot); "
                f"lower max_num_seqs to {max_state_reqs} or give more state memory"
            )

    if graph_sizes is not None and cudagraph_capture_sizes is not None:
        raise ConfigError(
            f"give graph_sizes (requests) or cudagraph_capture_sizes (tokens), not both: "
            f"graph_sizes={graph_sizes!r}, cudagraph_capture_sizes={cudagraph_capture_sizes!r}"
        )

    if cudagraph_capture_sizes is not None:
        tokens = _check_sizes("cudagraph_capture_sizes", cudagraph_capture_sizes)
        # The corrected list: round each size up to whole requests, clip, include the max.
        fixed = _complete([-(-t // bundle) for t in tokens], max_num_seqs)
        hint = (
            f"Use graph sizes in requests, graph_sizes={fixed} "
            f"(that is cudagraph_capture_sizes={[n * bundle for n in fixed]})"
        )
        ragged = [t for t in tokens if t % bundle]
        if ragged:
            raise ConfigError(
                f"num_spec={num_spec} gives bundle {bundle}; cudagraph_capture_sizes {tokens} "
                f"has sizes that are not multiples of {bundle}: {ragged}. Capture sizes count "
                f"tokens, and every decode step holds a whole number of requests of {bundle} "
                f"tokens. {hint}, or round every token size up to a multiple of {bundle}."
            )
        too_big = [t for t in tokens if t // bundle > max_num_seqs]
        if too_big:
            raise ConfigError(
                f"cudagraph_capture_sizes {tokens} has sizes above max_num_seqs*bundle="
                f"{max_num_seqs}*{bundle}={max_num_seqs * bundle}: {too_big}. {hint}, "
                f"or raise max_num_seqs."
            )
        return CapturePlan(num_spec, max_num_seqs, tuple(_complete([t // bundle for t in tokens], max_num_seqs)))

    if graph_sizes is not None:
        reqs = _check_sizes("graph_sizes", graph_sizes)
        # Never drop a too-large size silently (regression case 7): the user asked for it.
        too_big = [n for n in reqs if n > max_num_seqs]
        if too_big:
            raise ConfigError(
                f"graph_sizes {reqs} has request counts above max_num_seqs={max_num_seqs}: "
                f"{too_big}. Use graph_sizes={_complete(reqs, max_num_seqs)} or raise max_num_seqs."
            )
        return CapturePlan(num_spec, max_num_seqs, tuple(_complete(reqs, max_num_seqs)))

    return CapturePlan(num_spec, max_num_seqs, tuple(default_graph_sizes(max_num_seqs)))
