"""Ctrl-C around work that must not be cut short or lose it.

Python raises a Ctrl-C (SIGINT, or `_thread.interrupt_main`) as a KeyboardInterrupt in the main
thread, at whatever Python code that thread runs next. Two kinds of code must not take it there:

- Cleanup that frees what a call holds (aborting its requests, closing an engine): cut short by a
  second Ctrl-C, it would leave requests queued or an engine half closed.
- Finalizers: an `LLM` the garbage collector closes (`LLM.__del__`), an abandoned stream whose
  `finally` aborts its requests. The collector runs them in whatever thread allocates, the main
  thread included, in the middle of another call; CPython ignores an exception raised in a
  finalizer ("Exception ignored in ..."), so a Ctrl-C landing there would be lost, and the
  user's `generate` would go on as if it had not been pressed.
- Under tensor parallelism, an engine call rank 0 leads (engine/follow.py): the followers run
  its collectives with it, and a call abandoned halfway would leave them in a step.

`held()` runs such work with SIGINT recorded instead of raised (main thread only: no other
thread receives it) and delivers it when the outermost hold ends: raised there (`then="raise"`),
or (`then="redeliver"`, for cleanup that may be running inside a finalizer) handed back to the
main thread: raised at the start of its next engine call (`raise_pending`, in Engine.advance), or,
if none comes first, by a helper thread a moment later through the SIGINT handler in place
(Jupyter's, for one), at the main thread's next Python code, outside the finalizer. Nested holds
defer to the outermost.
"""

import _thread
import contextlib
import signal
import threading
import time

_depth = 0   # holds open on the main thread (only the main thread changes it)
_pending: list[int] = []   # presses held by a "redeliver" hold, not yet handed back
REDELIVER_AFTER = 0.02   # s: the main thread has left the finalizer by then (unless in a long chain of them)


def _take() -> bool:
    try:
        _pending.pop()   # atomic: the main thread and the helper thread never both take one press
        return True
    except IndexError:
        return False


def _later() -> None:
    time.sleep(REDELIVER_AFTER)
    if _take():
        _thread.interrupt_main()   # raised by the main thread's next Python code, via its SIGINT handler


def _redeliver() -> None:
    # Not threading.Thread: its start() waits for the new thread, whose press would then land in
    # the finalizer still running.
    _pending.append(1)
    _thread.start_new_thread(_later, ())


def raise_pending() -> None:
    """At the start of an engine call on the main thread: a press held in a finalizer's cleanup
    since is raised here, at once, rather than by the helper thread a little later."""
    if _pending and not _depth and threading.current_thread() is threading.main_thread() and _take():
        raise KeyboardInterrupt


@contextlib.contextmanager
def held(then: str = "raise"):
    """Run the block with Ctrl-C held (see the module docstring); `then`: "raise" or "redeliver"."""
    global _depth
    if threading.current_thread() is not threading.main_thread() or _depth or signal.getsignal(signal.SIGINT) is None:
        yield   # (None: a handler installed from C, which signal.signal could not put back)
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(1))
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        signal.signal(signal.SIGINT, previous)
        if pressed and then == "redeliver":
            _redeliver()
    if pressed and then == "raise":   # (when the block raised, its exception goes on instead)
        raise KeyboardInterrupt
