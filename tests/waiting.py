"""Waiting for a positive signal: poll a condition until it holds, with a deadline.

Tests wait *for* something (a socket, a log line, a list that the stand-in received), never a
fixed time. To show that something does not happen, wait first for a later effect that proves
the daemon got past the point where it would have happened, then assert the absence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, what: str | Callable[[], str] = "",
               *, interval: float = 0.02) -> T:
    """Call ``predicate`` until it returns something true, and return that; after ``timeout``
    seconds raise AssertionError with ``what`` (a text, or a function giving it, such as a log
    at that moment). An AssertionError the predicate raises (a process that died) ends the wait."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what() if callable(what) else what}")
        time.sleep(interval)
    return result
