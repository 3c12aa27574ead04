"""Waiting for a positive signal: poll a condition until it holds, with a deadline.

Tests wait *for* something (a socket, a log line, a list that the stand-in received), never a
fixed time. To show that something does not happen, wait first for a later effect that proves
the daemon got past the point where it would have happened, then assert the absence.

The one loop for it, in three forms: ``wait_until`` polls (or, given the ``threading.Condition``
that every change notifies, sleeps on it: the kubelet and API server stand-ins); ``wait_until_async``
polls from trio code without blocking the run. This module imports nothing but the standard
library and trio, lazily: the QEMU guest's scripts use it too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

What = str | Callable[[], str]


def _timed_out(timeout: float, what: What) -> AssertionError:
    return AssertionError(f"not within {timeout}s: {what() if callable(what) else what}")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, what: What = "", *, interval: float = 0.02,
               condition: threading.Condition | None = None) -> T:
    """Call ``predicate`` until it returns something true, and return that; after ``timeout``
    seconds raise AssertionError with ``what`` (a text, or a function giving it, such as a log
    at that moment). An AssertionError the predicate raises (a process that died) ends the wait.

    With ``condition`` (held by the caller), wait on it between calls instead of sleeping: whoever
    changes what the predicate reads notifies it and the wait ends at once; it ends after
    ``interval`` all the same, for a predicate that also reads what nobody notifies about."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(timeout, what)
        if condition is not None:
            condition.wait(min(interval, remaining))
        else:
            time.sleep(min(interval, remaining))
    return result


async def wait_until_async(predicate: Callable[[], T], timeout: float = 10.0, what: What = "", *,
                           interval: float = 0.005) -> T:
    """``wait_until`` from trio code: the predicate is polled every ``interval`` seconds of trio's
    clock while the rest of the run goes on."""
    import trio

    with trio.move_on_after(timeout):
        while not (result := predicate()):
            await trio.sleep(interval)
        return result
    if result := predicate():  # it came with the deadline
        return result
    raise _timed_out(timeout, what)

