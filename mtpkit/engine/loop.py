"""The engine loop: how many callers (threads, asyncio tasks, HTTP clients) share one engine.

There is no driver thread. The callers' streams step the engine themselves, one step at a time
(Engine's lock: a step, a queueing, an abort or a score), and a step advances every running
request, whoever queued it. A caller that finds another caller's step under way waits for that
step's end (Engine.advance: a condition, not the lock) and reports its tokens then, so every
stream reports at every step that advanced it; it steps itself only when nobody is. So a request queued by one caller joins the running batch at the
next step, whichever caller runs it (continuous batching across callers), and a caller waiting
for the lock loses nothing: the step it waits for advances its requests too. A caller owns only
its requests: closing or abandoning its stream, an interrupt or an exception in it aborts those
(LLM.stream's `finally`); an interrupted step's requests start over (Engine.step), so another
caller's tokens do not change. Why not one background thread that every caller feeds: a stream
is already told of its tokens at every step (no design does better: benchmarks/stream_gaps.py),
the facade's own stream (detokenizing, stop strings, logprobs, errors='return') stays the one
path every call takes, and nothing outlives the callers (no thread to start, stop or leak).
Under tensor parallelism the callers are rank 0's (engine/follow.py).

asyncio: a call runs on a thread of its own, never on the event loop (`run_call`,
`stream_call`), its events handed to the loop as they come. The requests the thread queues are
tracked (`CallTracker`, read by Engine.add), so cancelling the awaiting task (or closing the
async iterator) aborts exactly those, and the cancellation returns once they are freed.
"""

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator


class CallCancelled(Exception):
    """Raised in a call's thread when it queues a request after its task was cancelled (the
    facade's all-or-nothing queueing then aborts the ones already queued)."""


class CallTracker:
    """The requests one call's thread has queued, and whether the call was cancelled."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: list = []
        self.cancelled = False

    def add(self, req) -> None:
        with self._lock:
            if self.cancelled:
                raise CallCancelled("the call was cancelled")
            self.requests.append(req)

    def cancel(self) -> list:
        """Mark the call cancelled (no request can be queued by it from now on); returns the
        requests it queued so far."""
        with self._lock:
            self.cancelled = True
            return list(self.requests)


_tracker: contextvars.ContextVar[CallTracker | None] = contextvars.ContextVar("mtpkit_call_tracker", default=None)


def track(req) -> None:
    """Engine.add's hook: record `req` with the current thread's call, if it is a tracked one."""
    tracker = _tracker.get()
    if tracker is not None:
        tracker.add(req)


def _settle(fut: asyncio.Future, ok: bool, value) -> None:
    if not fut.done():
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """fn(*args) on the loop's thread; False when the loop is closed (nobody listens any more)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


async def _cancel(tracker: CallTracker, abort: Callable[[list], object], ended: asyncio.Future) -> None:
    """Abort the call's requests (on a worker thread: the engine lock may be held by a step) and
    wait for its thread to finish, so the requests are freed when this returns."""
    reqs = tracker.cancel()
    if reqs:
        await asyncio.to_thread(abort, reqs)
    await ended


async def run_call(fn: Callable[[], object], abort: Callable[[list], object]):
    """fn() on a thread of its own; its result (or exception) here. Cancelled: abort(requests
    fn queued), wait for fn to return, re-raise the CancelledError."""
    loop = asyncio.get_running_loop()
    ended = loop.create_future()
    tracker = CallTracker()

    def body():
        _tracker.set(tracker)
        try:
            ok, value = True, fn()
        except BaseException as e:   # noqa: BLE001 - handed to the awaiting task, raised there
            ok, value = False, e
        _post(loop, _settle, ended, ok, value)

    threading.Thread(target=body, name="mtpkit-call").start()
    try:
        return await asyncio.shield(ended)
    except asyncio.CancelledError:
        await _cancel(tracker, abort, ended)
        raise


_END = object()


async def stream_call(make_iter: Callable[[], Iterator], abort: Callable[[list], object]) -> AsyncIterator:
    """Iterate make_iter() on a thread of its own, yielding its items here as they come. The
    thread never waits for the consumer (items queue up here). Cancelled, or closed early
    (aclose, a `break` out of `async for` once the iterator is collected): abort its requests,
    close the iterator on its thread and wait for that thread to end."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    ended = loop.create_future()
    tracker = CallTracker()

    def body():
        _tracker.set(tracker)
        it, error = None, None
        try:
            it = make_iter()
            for item in it:
                if tracker.cancelled or not _post(loop, queue.put_nowait, (True, item)):
                    break
        except BaseException as e:   # noqa: BLE001 - handed to the consumer, raised there
            error = e
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()        # LLM.stream's finally: its requests aborted
                except BaseException as e:   # noqa: BLE001
                    error = error or e
            if error is not None and not tracker.cancelled:
                _post(loop, queue.put_nowait, (False, error))
            _post(loop, queue.put_nowait, (True, _END))
            _post(loop, _settle, ended, True, None)

    threading.Thread(target=body, name="mtpkit-stream").start()
    done = False
    try:
        while True:
            ok, item = await queue.get()
            if not ok:
                raise item
            if item is _END:
                done = True
                return
            yield item
    finally:
        if not done:
            await _cancel(tracker, abort, ended)
