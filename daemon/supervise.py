"""Keeping tasks alive: exponential backoff, and a task that fails started again after it.

A consumer of the tree or an endpoint that raises has a bug; the daemon logs it with the task's
name and runs the task again rather than ending (DESIGN: a failure is contained).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import trio

log = logging.getLogger("devplugd")

BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0


@dataclass
class Backoff:
    first: float = BACKOFF_FIRST
    maximum: float = BACKOFF_MAX
    _next: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._next = self.first

    def reset(self) -> None:
        self._next = self.first

    def next_delay(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.maximum)
        return delay


async def keep_running(name: str, task: Callable[[], Awaitable[None]], backoff: Backoff,
                       extra: Mapping[str, str] | None = None) -> None:
    """Run ``task`` until it returns; each time it raises, log it and run it again after the
    next delay of ``backoff``. Cancellation goes through."""
    while True:
        try:
            await task()
            return
        except Exception:
            delay = backoff.next_delay()
            log.exception("%s failed; starting it again in %.1fs", name, delay, extra=extra)
            await trio.sleep(delay)
