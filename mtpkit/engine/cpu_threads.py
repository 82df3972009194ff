"""torch's process-wide intra-op thread count, shared by every live engine of the process.

An engine of a small model on CPU runs on 1 thread (engine/build.py: set_cpu_threads). The count
is process-wide, so engines hold it together: while any engine that set a count is open, the
newest such engine's count is in force; when the last one closes, the count from before the
first is given back. A count the user set meanwhile (torch.set_num_threads) is theirs: it is
never overwritten.
"""

import threading

import torch

_lock = threading.Lock()
_holders: list[tuple[object, int]] = []   # (token, count) of the open engines that set one, oldest first
_state = {"original": None, "last_set": None}


def _set(count: int) -> None:
    torch.set_num_threads(count)
    _state["last_set"] = count


def hold(count: int) -> object:
    """Put `count` in force for a new engine; returns the token `release` takes."""
    with _lock:
        if not _holders:
            _state["original"] = torch.get_num_threads()
        token = object()
        _holders.append((token, count))
        if torch.get_num_threads() != count:
            _set(count)
        else:
            _state["last_set"] = count
        return token


def release(token: object) -> None:
    """An engine closed: the newest remaining engine's count, or the original when none is left,
    unless the user changed the count since mtpkit last set it. Releasing twice is harmless."""
    with _lock:
        kept = [h for h in _holders if h[0] is not token]
        if len(kept) == len(_holders):
            return
        _holders[:] = kept
        if torch.get_num_threads() != _state["last_set"]:
            return   # the user's count
        if _holders:
            _set(_holders[-1][1])
        elif _state["original"] is not None and _state["original"] != torch.get_num_threads():
            _set(_state["original"])
