"""The way onto the bus for the daemon's own parts: a host lease granted, a claim prepared, a
pool's slices withdrawn, a handler that found a device changed at Allocate.

The kernel sources await their own sends (the bus is a bounded channel: backpressure). These
parts cannot wait: they answer a gRPC call, or run in a worker thread. ``Inbox.post`` never
blocks and never starts a task: it files the event under its key, where a later event of the same
key replaces it (one ``LeasesChanged`` stands for any number of lease changes, one
``DeviceChanged`` per device), and one task (``run``) hands what is filed to the bus in order,
awaiting its room. So a flood of such events costs at most one filed event per key, and the keys
are bounded by the devices: past ``MAX_FILED`` a handler's device changes become one ``Resync``
of that handler (a full scan says everything they would).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import trio

from daemon.core import DeviceChanged, Event, Resync
from daemon.core._events import ClaimsChanged, LeasesChanged

MAX_FILED = 4096


def coalescing_key(event: Event) -> Hashable:
    """Events of one key say the same thing: only the newest needs to reach the loop."""
    if isinstance(event, DeviceChanged):
        return ("device", event.handler, event.devpath)
    if isinstance(event, Resync):
        return ("resync", event.handler)
    if isinstance(event, (LeasesChanged, ClaimsChanged)):
        return type(event).__name__
    return ("event", id(event))  # not coalesced


class Inbox:
    def __init__(self, send: trio.MemorySendChannel[Event]) -> None:
        self._send = send
        self._filed: dict[Hashable, Event] = {}
        self._wakeup = trio.Event()
        # made on the trio thread: a post from any other (a worker's allocation) goes through the token
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()

    def post(self, event: Event) -> None:
        """File ``event`` for the bus; from any thread, never blocking."""
        if threading.get_ident() != self._thread:
            self._token.run_sync_soon(self._file, event)
        else:
            self._file(event)

    def _file(self, event: Event) -> None:
        key = coalescing_key(event)
        if key not in self._filed and len(self._filed) >= MAX_FILED and isinstance(event, DeviceChanged):
            event = Resync(event.handler, f"more than {MAX_FILED} device changes waiting")
            key = coalescing_key(event)
        self._filed[key] = event
        self._wakeup.set()

    async def run(self) -> None:
        """Hand what is filed to the bus, oldest key first, for as long as the daemon runs."""
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            while self._filed:
                key = next(iter(self._filed))
                event = self._filed.pop(key)
                if isinstance(event, Resync) and event.handler is not None:  # it says what their changes would
                    for other in [k for k, e in self._filed.items()
                                  if isinstance(e, DeviceChanged) and e.handler == event.handler]:
                        del self._filed[other]
                await self._send.send(event)
