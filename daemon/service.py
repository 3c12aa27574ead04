"""systemd glue: readiness, status, reload and stop notices, and the watchdog.

All through systemd-python's ``sd_notify`` (a no-op when ``NOTIFY_SOCKET`` is unset, so the
daemon runs the same in a shell, a container or a unit):

* ``READY=1`` once the first tree is served and, when a kubelet is there, every pool registered;
* ``STATUS=`` a one-line summary (pools, devices, unhealthy, kubelet, a lost book), kept current;
* ``RELOADING=1`` then ``READY=1`` around a config reload; ``STOPPING=1`` on shutdown;
* ``WATCHDOG=1`` every half ``WATCHDOG_USEC``, sent by a task of the event loop itself: a wedged
  loop stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import trio
from systemd import daemon as sd_daemon

from daemon.core._tree import DeviceTree

log = logging.getLogger("devplugd.service")


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Seconds between pings (half of ``WATCHDOG_USEC``), if the watchdog is meant for us."""
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000


def status_line(tree: DeviceTree, served: int, registered: int, mode: str, lost_books: Sequence[str] = ()) -> str:
    devices = sum(len(pool.devices) for pool in tree.pools.values())
    unhealthy = sum(len(pool.devices) - pool.healthy_count for pool in tree.pools.values())
    if mode == "none":
        kubelet = "not registering"
    elif served == 0:
        kubelet = "nothing to register"
    elif registered == served:
        kubelet = f"all {served} registered"
    elif registered == 0:
        kubelet = "not connected"
    else:
        kubelet = f"{registered} of {served} registered"
    line = f"{len(tree.pools)} pools, {devices} devices, {unhealthy} unhealthy; kubelet: {kubelet}"
    for lost in lost_books:  # every device it could hold is held: the operator must know
        line += f"; LOST BOOK: {lost}"
    return line


class ServiceManager:
    """What systemd is told, and when. One per daemon."""

    def __init__(self) -> None:
        self._last_status = ""
        self.ready_sent = False

    @staticmethod
    def _notify(state: str) -> None:
        sd_daemon.notify(state)

    def ready(self) -> None:
        if not self.ready_sent:
            log.info("ready", extra={"EVENT": "ready"})
        self.ready_sent = True
        self._notify("READY=1")

    def reloading(self) -> None:
        self._notify("RELOADING=1")

    def reloaded(self) -> None:
        self._notify("READY=1")

    def stopping(self) -> None:
        self._notify("STOPPING=1")

    def status(self, line: str) -> None:
        if line != self._last_status:
            self._last_status = line
            self._notify(f"STATUS={line}")

    async def keep_watchdog_fed(self, environ: Mapping[str, str]) -> None:
        interval = watchdog_interval(environ)
        if interval is None:
            return
        log.info("watchdog: pinging every %.1fs", interval)
        while True:
            self._notify("WATCHDOG=1")
            await trio.sleep(interval)


class Registrations(Protocol):
    """What the STATUS line says of the kubelet side (the device-plugin endpoints)."""

    @property
    def mode(self) -> str: ...

    @property
    def served_count(self) -> int: ...

    @property
    def registered_count(self) -> int: ...


class StatusReporter:
    """Keeps ``STATUS=`` current: a subscriber of the notifier, and told by the endpoints when
    one starts serving or registers. Cheap: one line, sent only when it changed."""

    def __init__(self, service: ServiceManager, registrations: Registrations,
                 lost_books: Callable[[], Sequence[object]] = list) -> None:
        self._service = service
        self._registrations = registrations
        self._lost_books = lost_books
        self._tree = DeviceTree.empty()

    def offer(self, tree: DeviceTree) -> None:
        self._tree = tree
        self.refresh()

    def refresh(self) -> None:
        registrations = self._registrations
        self._service.status(status_line(self._tree, registrations.served_count, registrations.registered_count,
                                         registrations.mode, [str(book) for book in self._lost_books()]))
