"""Many callers on one LLM (issue 30; the design: mtpkit/engine/loop.py): threads and asyncio
tasks get exactly the serial run's tokens (greedy and seeded, with and without drafts, both
families), their requests are batched together (the engine's step log), an interrupted thread
or a cancelled task aborts only its own requests, and the pools are whole afterwards."""

import _thread
import asyncio
import threading
import time

import pytest

from mtpkit import LLM, SamplingParams
from mtpkit.errors import InputError

WORDS = ["def", "class", "import", "for", "while", "return", "try:", "with", "x =", "print(", "if", "lambda"]
# 8 callers x 4 prompts; each caller's prompts alternate greedy and seeded sampling
CALLS = [[f"{WORDS[(c + 3 * j) % len(WORDS)]} {c}{j}" for j in range(4)] for c in range(8)]
PARAMS = [SamplingParams(max_tokens=8) if j % 2 == 0 else SamplingParams(max_tokens=8, temperature=0.8, seed=7 + j)
          for j in range(4)]
LONG = SamplingParams(max_tokens=400, ignore_eos=True)   # a call still running when it is interrupted


@pytest.fixture(scope="module")
def llms():
    made = {}

    def get(name: str, num_spec: int):
        if (name, num_spec) not in made:
            made[name, num_spec] = LLM(name, num_spec=num_spec, max_model_len=512, enforce_eager=True)
        return made[name, num_spec]
    yield get
    for llm in made.values():
        llm.close()


@pytest.fixture(scope="module")
def serial(llms):
    """Each call's token ids, run one call after another."""
    runs = {}

    def get(name: str, num_spec: int):
        if (name, num_spec) not in runs:
            llm = llms(name, num_spec)
            runs[name, num_spec] = [[o.token_ids for o in llm.generate(c, PARAMS)] for c in CALLS]
        return runs[name, num_spec]
    return get


def assert_whole(llm):
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert llm.kv_pools.num_free == llm.kv_pools.capacity and llm.slots.num_free == llm.slots.capacity


def assert_mixed(llm, since: int, owner: dict[int, int]) -> None:
    """Some step after step `since` advanced requests of two callers (owner: request id -> caller)."""
    steps = [r for r in llm.engine.step_log.records() if r.index >= since]
    mixed = [r for r in steps if len({owner[i] for i in r.request_ids if i in owner}) >= 2]
    assert mixed, [r.request_ids for r in steps]


CASES = [(name, k) for name in ("tiny-qwen3-next", "tiny-gemma4") for k in (0, 3)]


@pytest.mark.parametrize(("name", "num_spec"), CASES)
def test_threads_and_tasks_equal_the_serial_run_and_share_steps(llms, serial, name, num_spec):
    llm, want = llms(name, num_spec), serial(name, num_spec)
    # 4 threads x 8 prompts (each thread two calls of 4)
    since, got, errors = llm.engine.step_log.num_steps, {}, []

    def caller(t):
        try:
            for c in (2 * t, 2 * t + 1):
                got[c] = llm.generate(CALLS[c], PARAMS)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    assert [[o.token_ids for o in got[c]] for c in range(8)] == want
    assert_mixed(llm, since, {o.request_id: c // 2 for c in got for o in got[c]})
    assert_whole(llm)

    # 8 asyncio tasks: agenerate and astream alternating
    async def task(c):
        if c % 2:
            return await llm.agenerate(CALLS[c], PARAMS)
        outs = {}
        async for ev in llm.astream(CALLS[c], PARAMS):
            if ev.finished:
                outs[ev.index] = ev.output
        return [outs[i] for i in sorted(outs)]

    async def main():
        return await asyncio.gather(*(task(c) for c in range(8)))
    since = llm.engine.step_log.num_steps
    outs = asyncio.run(main())
    assert [[o.token_ids for o in out] for out in outs] == want
    assert_mixed(llm, since, {o.request_id: c for c, out in enumerate(outs) for o in out})
    assert_whole(llm)


def test_astream_refuses_bad_input_before_queueing(llms):
    llm = llms("tiny-qwen3-next", 3)

    async def main():
        with pytest.raises(Exception, match="max_tokens"):
            async for _ in llm.astream(["fine", "bad"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=0)]):
                pass
        with pytest.raises(Exception, match="max_tokens"):
            await llm.agenerate("x", SamplingParams(max_tokens=0))
    since = llm.engine.step_log.num_steps
    asyncio.run(main())
    assert llm.engine.step_log.num_steps == since   # nothing ran
    assert_whole(llm)


def _others_threads(llm, results, errors):
    def caller(c):
        try:
            results[c] = llm.generate(CALLS[c], PARAMS)
        except BaseException as e:   # noqa: BLE001 - reported by the test
            errors.append(e)
    return [threading.Thread(target=caller, args=(c,)) for c in (1, 2, 3)]


def _long_running(llm) -> bool:
    """Whether a request of the LONG call is running and has emitted a few tokens."""
    return any(r.params.max_tokens == LONG.max_tokens and len(r.output_token_ids) >= 3
               for r in list(llm.scheduler.running))


def _owned_ids(llm, since: int, others: set[int]) -> set[int]:
    return {i for r in llm.engine.step_log.records() if r.index >= since for i in r.request_ids} - others


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma4"])
def test_an_interrupted_caller_aborts_only_its_own_requests(llms, serial, name):
    llm, want = llms(name, 3), serial(name, 3)
    since, results, errors = llm.engine.step_log.num_steps, {}, []
    threads = _others_threads(llm, results, errors)

    seen = {"polls": 0}

    def interrupter():   # Ctrl-C in the main thread once its call's requests have run a few steps
        deadline = time.monotonic() + 120
        while not _long_running(llm):   # however slowly the main thread gets there on a loaded machine
            seen["polls"] += 1
            if time.monotonic() > deadline:
                return   # no interrupt: the test fails below
            time.sleep(0.005)
        seen["fired"] = time.monotonic()
        _thread.interrupt_main()
    for th in [*threads, threading.Thread(target=interrupter, daemon=True)]:
        th.start()
    try:
        llm.generate(["while True:", "for i in"], LONG)
    except KeyboardInterrupt:
        pass
    else:
        import signal
        pytest.fail(f"the call returned without the interrupt (interrupter: {seen}, returned at {time.monotonic()}, "
                    f"SIGINT handler {signal.getsignal(signal.SIGINT)!r})")
    after = llm.engine.step_log.num_steps   # the interrupted call's abort has run: no later step may hold its requests
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    others = {o.request_id for out in results.values() for o in out}
    mine = _owned_ids(llm, since, others)
    assert mine, "the interrupted call's requests ran before the interrupt"
    later = [r.request_ids for r in llm.engine.step_log.records() if r.index >= after]
    assert not mine & {i for ids in later for i in ids}, "an interrupted call's request ran on"
    assert [[o.token_ids for o in results[c]] for c in (1, 2, 3)] == want[1:4]
    assert_whole(llm)


@pytest.mark.parametrize("how", ["astream", "agenerate"])
def test_a_cancelled_task_aborts_only_its_own_requests(llms, serial, how):
    llm, want = llms("tiny-qwen3-next", 3), serial("tiny-qwen3-next", 3)
    since = llm.engine.step_log.num_steps

    async def doomed():
        if how == "agenerate":
            await llm.agenerate(["while True:", "for i in"], LONG)
        else:
            async for _ in llm.astream(["while True:", "for i in"], LONG):
                pass

    async def main():
        others = [asyncio.ensure_future(llm.agenerate(CALLS[c], PARAMS)) for c in (1, 2, 3)]
        victim = asyncio.ensure_future(doomed())
        bad = asyncio.ensure_future(llm.agenerate("x", SamplingParams(max_tokens=0)))   # raises in its caller only
        deadline = time.monotonic() + 120
        while not _long_running(llm) and time.monotonic() < deadline:   # its requests are under way
            await asyncio.sleep(0.005)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        with pytest.raises(InputError, match="max_tokens"):
            await bad
        # the cancellation returns once its requests are aborted: nothing of it is queued or running
        after = llm.engine.step_log.num_steps
        held = [r for r in [*llm.scheduler.running, *llm.scheduler.waiting] if r.params.max_tokens == LONG.max_tokens]
        return await asyncio.gather(*others), after, held
    results, after, held = asyncio.run(main())
    assert not held
    others = {o.request_id for out in results for o in out}
    mine = _owned_ids(llm, since, others)
    assert mine
    later = [r.request_ids for r in llm.engine.step_log.records() if r.index >= after]
    assert not mine & {i for ids in later for i in ids}
    assert [[o.token_ids for o in out] for out in results] == want[1:4]
    assert_whole(llm)


def test_concurrent_streams_report_their_tokens_at_every_step(llms):
    """Two streams at once: each sees its request's tokens at every step that advanced it, one
    token per event (num_spec 0), whichever caller ran the step (Engine.advance), not in bursts
    at its own next step. Each step is slowed a little (as a real model's is, compared with a
    caller's reporting) so that a waiting caller is woken and reports before the next step ends."""
    llm = llms("tiny-qwen3-next", 0)
    runner, execute = llm.runner, llm.runner.execute

    def slow(plan):
        out = execute(plan)
        time.sleep(0.005)
        return out
    runner.execute = slow
    since, go, events, errors = llm.engine.step_log.num_steps, threading.Barrier(2), {}, []

    def caller(c):
        try:
            go.wait()
            events[c] = [(ev.output.request_id, ev.new_token_ids) for ev in
                         llm.stream(f"{WORDS[c]} {c}", SamplingParams(max_tokens=12, ignore_eos=True))]
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
    try:
        threads = [threading.Thread(target=caller, args=(c,)) for c in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        del runner.execute
    assert not errors, errors
    steps = [r for r in llm.engine.step_log.records() if r.index >= since]
    assert any(len(r.request_ids) == 2 for r in steps), "the two streams' requests shared steps"
    for c in range(2):
        rid = events[c][0][0]
        with_tokens = [ids for _, ids in events[c] if ids]
        assert [len(ids) for ids in with_tokens] == [1] * 12, with_tokens   # never a burst
        assert len(with_tokens) == sum(rid in r.request_ids for r in steps)
    assert_whole(llm)
