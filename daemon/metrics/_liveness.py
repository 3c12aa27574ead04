"""When the trio loop last ran, for ``/healthz``: a liveness probe's view of what systemd's
watchdog checks under the unit (a wedged loop is restarted; a busy one is not)."""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

# As the unit's WatchdogSec: no beat for this long is a wedged loop.
STALE_AFTER = 10.0
BEAT_INTERVAL = 1.0


class Liveness:
    """Beaten by a task of the trio loop, read by the metrics server's threads (a float
    assignment: no lock needed)."""

    def __init__(self, stale_after: float = STALE_AFTER, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self._clock = clock
        self._last_beat = clock()

    def beat(self) -> None:
        self._last_beat = self._clock()

    def silence(self) -> float:
        """Seconds since the loop last beat."""
        return self._clock() - self._last_beat

    def alive(self) -> bool:
        return self.silence() <= self.stale_after

    async def keep_beating(self, interval: float = BEAT_INTERVAL) -> None:
        while True:
            self.beat()
            await trio.sleep(interval)
