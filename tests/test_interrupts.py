"""Ctrl-C where Python would lose it or cut cleanup short (mtpkit/engine/interrupts.py): in a
finalizer the garbage collector runs in the main thread (an LLM collected, an abandoned stream),
and a second Ctrl-C during the abort of an interrupted call. Each press is planted with
`_thread.interrupt_main()` inside the engine's abort, followed by more Python code, so that it
lands there as a real Ctrl-C would."""

import _thread
import gc
import time

import pytest

from mtpkit import LLM, SamplingParams

LONG = SamplingParams(max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3-next", num_spec=3, max_model_len=256, enforce_eager=True) as llm:
        yield llm


def _press_inside(engine, name: str):
    """engine.<name> presses Ctrl-C, runs some Python, then does its work."""
    real = getattr(engine, name)

    def pressed(*args, **kwargs):
        _thread.interrupt_main()
        for _ in range(10_000):   # the press is raised at the main thread's next Python code: here
            pass
        return real(*args, **kwargs)
    setattr(engine, name, pressed)


def _wait(seconds: float = 5.0) -> None:
    """Python code in the main thread for a while: a press handed back to it is raised here."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.001)


def assert_whole(llm):
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert llm.kv_pools.num_free == llm.kv_pools.capacity and llm.slots.num_free == llm.slots.capacity


def test_a_ctrl_c_in_an_llm_the_collector_closes_reaches_the_main_thread():
    doomed = LLM("tiny-qwen3-next", max_model_len=128, enforce_eager=True)
    engine = doomed.engine
    doomed.generate("def", SamplingParams(max_tokens=2))
    _press_inside(engine, "abort")   # engine.close aborts what is left
    doomed.cycle = doomed   # only the collector frees it
    del doomed
    with pytest.raises(KeyboardInterrupt):
        gc.collect()   # LLM.__del__ in the main thread
        _wait()
    assert engine.closed and not hasattr(engine, "runner")   # and it closed all the way


def test_a_ctrl_c_in_an_abandoned_streams_cleanup_reaches_the_main_thread(llm):
    events = llm.stream(["while True:", "for i in"], LONG)
    next(events)
    assert llm.scheduler.running
    _press_inside(llm.engine, "abort")
    try:
        with pytest.raises(KeyboardInterrupt):
            del events   # the generator's finalizer aborts its requests, in the main thread
            _wait()
    finally:
        del llm.engine.abort
    assert_whole(llm)   # the press did not cut the abort short


def test_a_second_ctrl_c_during_an_interrupted_calls_abort(llm):
    steps, presses = [0], []
    real_advance = llm.engine.advance

    def advance():   # the first press, after a few steps
        steps[0] += 1
        if steps[0] == 3:
            _press_inside(llm.engine, "abort")   # the second, inside the abort it causes
            raise KeyboardInterrupt
        return real_advance()
    llm.engine.advance = advance
    try:
        deadline = time.monotonic() + 5
        while len(presses) < 2 and time.monotonic() < deadline:
            try:
                try:
                    if not presses:
                        llm.generate(["while True:", "for i in"], LONG)
                    else:
                        time.sleep(0.001)
                except KeyboardInterrupt:
                    presses.append(time.monotonic())
            except KeyboardInterrupt:   # the second, landing in the first one's handler
                presses.append(time.monotonic())
    finally:
        del llm.engine.advance
        llm.engine.__dict__.pop("abort", None)
    assert len(presses) == 2, "the second Ctrl-C was lost"
    assert_whole(llm)   # nor did it cut the first one's abort short
    assert len(llm.generate("def", SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4   # usable
