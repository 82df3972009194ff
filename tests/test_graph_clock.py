"""benchmarks/graph_clock.py, what ab_revisions.py and host_cold.py split a step with: every graph
of an engine wrapped in place, its replays timed, the tokens unchanged."""

import sys
from pathlib import Path

import pytest

from mtpkit import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from graph_clock import GraphClock, graphs_of, replace_graphs  # noqa: E402


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_graph_replay_is_timed_and_the_tokens_stay():
    # float64 and no prefix cache: the second run's prefills are the first's (a cache hit prefills a
    # shorter chunk, whose float32 rounding could flip a near-tie on another CPU)
    llm = LLM("tiny-qwen3-next", num_spec=2, max_num_seqs=1, dtype="float64", enable_prefix_caching=False)
    llm.runner.graphs.trace_after = 0
    prompts, sp = ["def f(x):", "import os\n"], SamplingParams(max_tokens=10, ignore_eos=True)
    want = [llm.generate([p], sp)[0].token_ids for p in prompts]   # every graph made
    graphs = graphs_of(llm.runner.graphs)
    names = {name for name, _ in graphs}
    assert {"verify_graphs", "propose_graphs"} <= names
    clock, calls = GraphClock(), []

    def wrap(key, fn):
        timed = clock.timed(fn)

        def replay(*a):
            calls.append(key)
            return timed(*a)
        return replay
    replace_graphs(llm.runner.graphs, graphs, wrap)
    assert [llm.generate([p], sp)[0].token_ids for p in prompts] == want
    assert clock.seconds > 0 and {name for name, _ in calls} >= {"verify_graphs", "propose_graphs"}
