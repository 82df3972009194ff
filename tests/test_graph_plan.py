"""The decode CUDA-graph capture plan: sizes are request counts, never ragged token counts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpkit.errors import ConfigError
from mtpkit.graphs import CapturePlan, build_capture_plan, default_graph_sizes

NUM_SPECS = range(0, 8)
MAX_NUM_SEQS = (1, 3, 5, 8, 13, 64)


def assert_plan_invariants(plan: CapturePlan, num_spec: int, max_num_seqs: int) -> None:
    bundle = num_spec + 1
    assert plan.num_spec == num_spec and plan.max_num_seqs == max_num_seqs
    assert plan.bundle == bundle
    assert all(isinstance(n, int) and 1 <= n <= max_num_seqs for n in plan.sizes)
    assert all(a < b for a, b in zip(plan.sizes, plan.sizes[1:]))
    assert plan.sizes[-1] == max_num_seqs
    assert plan.token_sizes == tuple(n * bundle for n in plan.sizes)
    assert all(t % bundle == 0 for t in plan.token_sizes)
    assert plan.capture_order() == tuple(sorted(plan.sizes, reverse=True))
    for n in range(1, max_num_seqs + 1):
        padded = plan.dispatch(n)
        assert padded in plan.sizes
        assert padded == min(s for s in plan.sizes if s >= n)


@pytest.mark.parametrize("max_num_seqs", MAX_NUM_SEQS)
@pytest.mark.parametrize("num_spec", NUM_SPECS)
def test_default_plan_invariants(num_spec, max_num_seqs):
    plan = build_capture_plan(num_spec=num_spec, max_num_seqs=max_num_seqs)
    assert_plan_invariants(plan, num_spec, max_num_seqs)
    assert list(plan.sizes) == default_graph_sizes(max_num_seqs)


@pytest.mark.parametrize("max_num_seqs", MAX_NUM_SEQS)
@pytest.mark.parametrize("num_spec", NUM_SPECS)
def test_explicit_plan_invariants(num_spec, max_num_seqs):
    bundle = num_spec + 1
    reqs = [1, max_num_seqs // 2 or 1, 1]  # duplicates, unsorted, max missing
    by_reqs = build_capture_plan(num_spec=num_spec, max_num_seqs=max_num_seqs, graph_sizes=reqs)
    by_tokens = build_capture_plan(
        num_spec=num_spec, max_num_seqs=max_num_seqs, cudagraph_capture_sizes=[n * bundle for n in reqs]
    )
    assert by_reqs == by_tokens
    assert_plan_invariants(by_reqs, num_spec, max_num_seqs)


def test_default_sizes():
    assert default_graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_graph_sizes(13) == [1, 2, 4, 8, 13]
    assert default_graph_sizes(1) == [1]
    assert default_graph_sizes(5) == [1, 2, 4, 5]
    assert default_graph_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_describe_and_order():
    plan = build_capture_plan(num_spec=2, max_num_seqs=8)
    assert plan.describe() == "num_spec=2 bundle=3: graphs for 1,2,4,8 requests (3,6,12,24 tokens)"
    assert plan.capture_order() == (8, 4, 2, 1)


@pytest.mark.parametrize("num_reqs", [0, -1, 9, True, 2.0])
def test_dispatch_out_of_range(num_reqs):
    plan = build_capture_plan(num_spec=1, max_num_seqs=8)
    with pytest.raises(ConfigError, match="num_reqs"):
        plan.dispatch(num_reqs)


def test_regression_1_ragged_capture_sizes():
    # vLLM #25647: num_spec=2 with token sizes [1, 2, 4, ...] made a ragged capture batch.
    with pytest.raises(ConfigError) as info:
        build_capture_plan(num_spec=2, max_num_seqs=32, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])
    msg = str(info.value)
    assert "bundle 3" in msg
    assert "[1, 2, 4, 8, 16, 32]" in msg  # the offending sizes
    assert "graph_sizes=[1, 2, 3, 6, 11, 32]" in msg  # the corrected list, in requests
    assert "cudagraph_capture_sizes=[3, 6, 9, 18, 33, 96]" in msg  # and in tokens
    # The same numbers given as request counts are fine.
    plan = build_capture_plan(num_spec=2, max_num_seqs=32, graph_sizes=[1, 2, 4, 8, 16, 32])
    assert plan.sizes == (1, 2, 4, 8, 16, 32)
    assert plan.token_sizes == (3, 6, 12, 24, 48, 96)


def test_corrected_list_is_clipped_and_includes_max():
    with pytest.raises(ConfigError) as info:
        build_capture_plan(num_spec=2, max_num_seqs=6, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 40])
    msg = str(info.value)
    assert "not multiples of 3: [1, 2, 4, 8, 16, 40]" in msg
    assert "graph_sizes=[1, 2, 3, 6]" in msg and "cudagraph_capture_sizes=[3, 6, 9, 18]" in msg


def test_bundle_4_token_sizes_accepted():
    # num_spec=3: bundle 4 divides every power of two >= 4, the case that happened to work.
    plan = build_capture_plan(num_spec=3, max_num_seqs=4, cudagraph_capture_sizes=[4, 8, 16])
    assert plan.sizes == (1, 2, 4)
    assert plan.token_sizes == (4, 8, 16)


def test_regression_4_pool_too_small():
    # vLLM #34094: decode batch wider than the state-slot pool asserted at capture.
    with pytest.raises(ConfigError) as info:
        build_capture_plan(num_spec=2, max_num_seqs=64, max_state_reqs=40)
    msg = str(info.value)
    assert "max_num_seqs=64" in msg and "40" in msg and "bundle=3" in msg
    assert "lower max_num_seqs to 40" in msg
    plan = build_capture_plan(num_spec=2, max_num_seqs=40, max_state_reqs=40)
    assert plan.sizes[-1] == 40


def test_regression_7_max_size_not_truncated():
    # vLLM #54933: an explicit size above the limit was silently dropped and the widest
    # batch ran eager. Here it is an error, and max_num_seqs always gets a graph.
    with pytest.raises(ConfigError) as info:
        build_capture_plan(num_spec=1, max_num_seqs=64, graph_sizes=[1, 2, 4, 8, 16, 32, 64, 128])
    assert "[128]" in str(info.value) and "max_num_seqs=64" in str(info.value)
    with pytest.raises(ConfigError, match=r"\[256\]"):
        build_capture_plan(num_spec=1, max_num_seqs=64, cudagraph_capture_sizes=[2, 128, 256])
    plan = build_capture_plan(num_spec=1, max_num_seqs=64, graph_sizes=[1, 2, 4])
    assert plan.sizes == (1, 2, 4, 64)
    assert plan.dispatch(64) == 64 and plan.dispatch(5) == 64


def test_regression_8_sizes_not_rounded():
    # vLLM #46324: piecewise sizes not rounded to the bundle. Any non-multiple is refused,
    # even when most sizes are fine, and only the bad ones are named as offending.
    with pytest.raises(ConfigError) as info:
        build_capture_plan(num_spec=3, max_num_seqs=16, cudagraph_capture_sizes=[4, 8, 12, 14, 64])
    msg = str(info.value)
    assert "not multiples of 4: [14]" in msg
    assert "graph_sizes=[1, 2, 3, 4, 16]" in msg


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_spec=-1, max_num_seqs=8),
        dict(num_spec=9, max_num_seqs=8),
        dict(num_spec=True, max_num_seqs=8),
        dict(num_spec=1.0, max_num_seqs=8),
        dict(num_spec=1, max_num_seqs=0),
        dict(num_spec=1, max_num_seqs=False),
        dict(num_spec=1, max_num_seqs=8, max_state_reqs=0),
        dict(num_spec=1, max_num_seqs=8, graph_sizes=[], cudagraph_capture_sizes=None),
        dict(num_spec=1, max_num_seqs=8, cudagraph_capture_sizes=[]),
        dict(num_spec=1, max_num_seqs=8, graph_sizes=[1, 0]),
        dict(num_spec=1, max_num_seqs=8, graph_sizes=[-2, 4]),
        dict(num_spec=1, max_num_seqs=8, graph_sizes=[1, True]),
        dict(num_spec=1, max_num_seqs=8, graph_sizes=[1, 2.0]),
        dict(num_spec=1, max_num_seqs=8, graph_sizes="1,2"),
        dict(num_spec=1, max_num_seqs=8, graph_sizes=4),
        dict(num_spec=1, max_num_seqs=8, cudagraph_capture_sizes=[2, None]),
        dict(num_spec=1, max_num_seqs=8, graph_sizes=[1], cudagraph_capture_sizes=[2]),
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(ConfigError):
        build_capture_plan(**kwargs)


def test_bad_sizes_are_named():
    with pytest.raises(ConfigError, match=r"\[0, -3, True\]"):
        build_capture_plan(num_spec=1, max_num_seqs=8, graph_sizes=[1, 0, -3, True])


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1, 4), (1, 1, 4), (0, 4), ()])
def test_hand_built_plan_checked(sizes):
    with pytest.raises(ConfigError):
        CapturePlan(num_spec=1, max_num_seqs=4, sizes=sizes)


size_lists = st.lists(st.integers(min_value=-4, max_value=200), min_size=0, max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    num_spec=st.integers(0, 8),
    max_num_seqs=st.integers(1, 70),
    sizes=size_lists,
    as_tokens=st.booleans(),
)
def test_random_size_lists(num_spec, max_num_seqs, sizes, as_tokens):
    bundle = num_spec + 1
    if as_tokens:
        valid = bool(sizes) and all(t >= 1 and t % bundle == 0 and t // bundle <= max_num_seqs for t in sizes)
        reqs = [t // bundle for t in sizes]
        kwargs = dict(cudagraph_capture_sizes=sizes)
    else:
        valid = bool(sizes) and all(1 <= n <= max_num_seqs for n in sizes)
        reqs = list(sizes)
        kwargs = dict(graph_sizes=sizes)
    if not valid:
        with pytest.raises(ConfigError):
            build_capture_plan(num_spec=num_spec, max_num_seqs=max_num_seqs, **kwargs)
        return
    plan = build_capture_plan(num_spec=num_spec, max_num_seqs=max_num_seqs, **kwargs)
    assert set(plan.sizes) == set(reqs) | {max_num_seqs}
    if max_num_seqs <= 13:  # keep the dispatch sweep cheap
        assert_plan_invariants(plan, num_spec, max_num_seqs)


@settings(max_examples=200, deadline=None)
@given(
    num_spec=st.integers(0, 8),
    max_num_seqs=st.integers(1, 64),
    data=st.data(),
)
def test_random_valid_plans(num_spec, max_num_seqs, data):
    # Valid by construction, so the property above is not dominated by rejections.
    reqs = data.draw(st.lists(st.integers(1, max_num_seqs), min_size=1, max_size=8))
    as_tokens = data.draw(st.booleans())
    bundle = num_spec + 1
    kwargs = dict(cudagraph_capture_sizes=[n * bundle for n in reqs]) if as_tokens else dict(graph_sizes=reqs)
    plan = build_capture_plan(num_spec=num_spec, max_num_seqs=max_num_seqs, **kwargs)
    assert_plan_invariants(plan, num_spec, max_num_seqs)
    assert set(plan.sizes) == set(reqs) | {max_num_seqs}


junk = st.one_of(st.integers(-3, 40), st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2))


@settings(max_examples=200, deadline=None)
@given(
    num_spec=st.one_of(st.integers(-2, 10), junk),
    max_num_seqs=st.one_of(st.integers(-2, 20), junk),
    sizes=st.one_of(st.lists(junk, max_size=6), junk),
    as_tokens=st.booleans(),
)
def test_random_junk_only_config_errors(num_spec, max_num_seqs, sizes, as_tokens):
    # Whatever comes in, the only failure is a ConfigError (never TypeError etc.).
    kwargs = dict(cudagraph_capture_sizes=sizes) if as_tokens else dict(graph_sizes=sizes)
    try:
        plan = build_capture_plan(num_spec=num_spec, max_num_seqs=max_num_seqs, **kwargs)
    except ConfigError:
        return
    assert_plan_invariants(plan, num_spec, max_num_seqs)
