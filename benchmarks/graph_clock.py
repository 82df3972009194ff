"""The time a CPU engine spends inside its graph replays, for the benchmarks that compare the host
work around them (ab_revisions.py, host_cold.py): every traced (or compiled) graph of a
CapturedSteps wrapped in place."""

import time

GRAPH_DICTS = ("verify_graphs", "decode_graphs", "propose_graphs", "prefill_graphs", "prefill_proposal_graphs", "control_graphs",
               "sample_graphs")


class GraphClock:
    """Seconds inside the wrapped replays so far (`seconds`, reset by the caller)."""

    def __init__(self):
        self.seconds = 0.0

    def timed(self, fn):
        def replay(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.seconds += time.perf_counter() - t
        return replay


def graphs_of(captured) -> dict:
    """{(dict name, key): graph} of every graph made so far (the ones a later run replays must
    have been made in a warm-up)."""
    return {(name, key): fn for name in GRAPH_DICTS for key, fn in getattr(captured, name, {}).items()
            if fn is not None}


def replace_graphs(captured, graphs: dict, wrap) -> None:
    """Put wrap((dict name, key), fn) in place of each of `graphs` (graphs_of's)."""
    for (name, key), fn in graphs.items():
        getattr(captured, name)[key] = wrap((name, key), fn)
